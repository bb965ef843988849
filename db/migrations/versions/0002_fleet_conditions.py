"""leases, run liveness, winner conditions

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('opsadv_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('host', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('pid', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table('opsadv_winners', schema=None) as batch_op:
        batch_op.add_column(sa.Column('conditions', sa.JSON(), nullable=True))
    op.create_table('opsadv_leases',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('device_class', sa.String(length=64), nullable=False),
    sa.Column('problem_id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['problem_id'], ['opsadv_problems.id'], ),
    sa.ForeignKeyConstraint(['run_id'], ['opsadv_runs.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('device_class', 'problem_id')
    )
    with op.batch_alter_table('opsadv_leases', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_opsadv_leases_run_id'), ['run_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('opsadv_leases', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_opsadv_leases_run_id'))
    op.drop_table('opsadv_leases')
    with op.batch_alter_table('opsadv_winners', schema=None) as batch_op:
        batch_op.drop_column('conditions')
    with op.batch_alter_table('opsadv_runs', schema=None) as batch_op:
        batch_op.drop_column('heartbeat_at')
        batch_op.drop_column('pid')
        batch_op.drop_column('host')
