"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-12-02
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('opsadv_devices',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('device_class', sa.String(length=64), nullable=False),
    sa.Column('fingerprint', sa.JSON(), nullable=False),
    sa.Column('fingerprint_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('fingerprint_hash')
    )
    with op.batch_alter_table('opsadv_devices', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_opsadv_devices_device_class'), ['device_class'], unique=False)

    op.create_table('opsadv_problems',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('op', sa.String(length=64), nullable=False),
    sa.Column('key', sa.String(length=512), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('op', 'key')
    )
    with op.batch_alter_table('opsadv_problems', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_opsadv_problems_op'), ['op'], unique=False)

    op.create_table('opsadv_runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('device_class', sa.String(length=64), nullable=False),
    sa.Column('command', sa.Text(), nullable=False),
    sa.Column('sampler', sa.String(length=32), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('opsadv_trials',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('problem_id', sa.Integer(), nullable=False),
    sa.Column('device_id', sa.Integer(), nullable=True),
    sa.Column('study', sa.String(length=256), nullable=False),
    sa.Column('optuna_number', sa.Integer(), nullable=True),
    sa.Column('impl', sa.String(length=128), nullable=False),
    sa.Column('kernel_version', sa.String(length=32), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('median_ms', sa.Float(), nullable=True),
    sa.Column('spread_ms', sa.Float(), nullable=True),
    sa.Column('rel_error', sa.Float(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['device_id'], ['opsadv_devices.id'], ),
    sa.ForeignKeyConstraint(['problem_id'], ['opsadv_problems.id'], ),
    sa.ForeignKeyConstraint(['run_id'], ['opsadv_runs.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('opsadv_trials', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_opsadv_trials_problem_id'), ['problem_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_opsadv_trials_run_id'), ['run_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_opsadv_trials_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_opsadv_trials_study'), ['study'], unique=False)

    op.create_table('opsadv_winners',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('device_class', sa.String(length=64), nullable=False),
    sa.Column('problem_id', sa.Integer(), nullable=False),
    sa.Column('device_id', sa.Integer(), nullable=True),
    sa.Column('run_id', sa.Integer(), nullable=True),
    sa.Column('study', sa.String(length=256), nullable=False),
    sa.Column('impl', sa.String(length=128), nullable=False),
    sa.Column('kernel_version', sa.String(length=32), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('median_ms', sa.Float(), nullable=False),
    sa.Column('spread_ms', sa.Float(), nullable=False),
    sa.Column('vendor_impl', sa.String(length=128), nullable=False),
    sa.Column('vendor_ms', sa.Float(), nullable=False),
    sa.Column('speedup', sa.Float(), nullable=False),
    sa.Column('trials', sa.Integer(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['device_id'], ['opsadv_devices.id'], ),
    sa.ForeignKeyConstraint(['problem_id'], ['opsadv_problems.id'], ),
    sa.ForeignKeyConstraint(['run_id'], ['opsadv_runs.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('device_class', 'problem_id')
    )
    with op.batch_alter_table('opsadv_winners', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_opsadv_winners_device_class'), ['device_class'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('opsadv_winners', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_opsadv_winners_device_class'))

    op.drop_table('opsadv_winners')
    with op.batch_alter_table('opsadv_trials', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_opsadv_trials_study'))
        batch_op.drop_index(batch_op.f('ix_opsadv_trials_status'))
        batch_op.drop_index(batch_op.f('ix_opsadv_trials_run_id'))
        batch_op.drop_index(batch_op.f('ix_opsadv_trials_problem_id'))

    op.drop_table('opsadv_trials')
    op.drop_table('opsadv_runs')
    with op.batch_alter_table('opsadv_problems', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_opsadv_problems_op'))

    op.drop_table('opsadv_problems')
    with op.batch_alter_table('opsadv_devices', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_opsadv_devices_device_class'))

    op.drop_table('opsadv_devices')
