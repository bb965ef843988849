"""winner history: measurements of a problem not stored as its winner

Revision ID: 0003
Revises: 0002
Create Date: 2027-01-10
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('opsadv_winners', schema=None) as batch_op:
        batch_op.add_column(sa.Column('history', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('opsadv_winners', schema=None) as batch_op:
        batch_op.drop_column('history')
