from __future__ import annotations

from alembic import context

from db.models import Base

config = context.config
VERSION_TABLE = "opsadv_alembic_version"


def _include(obj, name, type_, reflected, compare_to):
    # Optuna's tables live in the same database; they are not ours to migrate.
    return type_ != "table" or name.startswith("opsadv_")


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is None:
        from sqlalchemy import create_engine

        connectable = create_engine(config.get_main_option("sqlalchemy.url"))
        with connectable.connect() as conn:
            _run(conn)
    else:
        _run(connectable)


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        include_object=_include,
        render_as_batch=True,  # SQLite ALTERs go through table copies
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=Base.metadata, version_table=VERSION_TABLE)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
