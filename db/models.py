"""ops-adv's own tables (prefixed opsadv_ so Optuna's tables can share the database)."""
from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import JSON, Float, ForeignKey, Integer, String, Text, UniqueConstraint, DateTime
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class Device(Base):
    """One concrete machine configuration: class plus fingerprint (name, versions, ...)."""

    __tablename__ = "opsadv_devices"
    __table_args__ = (UniqueConstraint("fingerprint_hash"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_class: Mapped[str] = mapped_column(String(64), index=True)
    fingerprint: Mapped[dict] = mapped_column(JSON)
    fingerprint_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Problem(Base):
    __tablename__ = "opsadv_problems"
    __table_args__ = (UniqueConstraint("op", "key"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    op: Mapped[str] = mapped_column(String(64), index=True)
    key: Mapped[str] = mapped_column(String(512))  # canonical JSON of the problem signature


class Run(Base):
    __tablename__ = "opsadv_runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_class: Mapped[str] = mapped_column(String(64))
    command: Mapped[str] = mapped_column(Text)
    sampler: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(32), default="running")  # running, finished, interrupted, failed
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)  # a live run renews it


class Trial(Base):
    """Every measured (or refused) configuration, with its status and error text."""

    __tablename__ = "opsadv_trials"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("opsadv_runs.id"), index=True)
    problem_id: Mapped[int] = mapped_column(ForeignKey("opsadv_problems.id"), index=True)
    device_id: Mapped[int | None] = mapped_column(ForeignKey("opsadv_devices.id"), nullable=True)
    study: Mapped[str] = mapped_column(String(256), index=True)
    optuna_number: Mapped[int | None] = mapped_column(Integer, nullable=True)
    impl: Mapped[str] = mapped_column(String(128))
    kernel_version: Mapped[str] = mapped_column(String(32))
    params: Mapped[dict] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(32), index=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    median_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    spread_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    rel_error: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Winner(Base):
    """The implementation to dispatch for one problem on one device class."""

    __tablename__ = "opsadv_winners"
    __table_args__ = (UniqueConstraint("device_class", "problem_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_class: Mapped[str] = mapped_column(String(64), index=True)
    problem_id: Mapped[int] = mapped_column(ForeignKey("opsadv_problems.id"))
    device_id: Mapped[int | None] = mapped_column(ForeignKey("opsadv_devices.id"), nullable=True)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("opsadv_runs.id"), nullable=True)
    study: Mapped[str] = mapped_column(String(256))
    impl: Mapped[str] = mapped_column(String(128))
    kernel_version: Mapped[str] = mapped_column(String(32))
    params: Mapped[dict] = mapped_column(JSON)
    median_ms: Mapped[float] = mapped_column(Float)
    spread_ms: Mapped[float] = mapped_column(Float)
    vendor_impl: Mapped[str] = mapped_column(String(128))
    vendor_ms: Mapped[float] = mapped_column(Float)
    speedup: Mapped[float] = mapped_column(Float)
    trials: Mapped[int] = mapped_column(Integer, default=0)
    # threads, torch, triton, cuda, cudnn, cublas, driver, sm_clock_mhz, power_limit_w, ecc: what it was measured under
    conditions: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    # measurements of this problem not stored: a slower re-measurement kept out, the winner it replaced, confirmation rounds
    history: Mapped[list | None] = mapped_column(JSON, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)


class Lease(Base):
    """One tuner process holds a problem at a time; it renews `expires_at`, and an expired lease is taken over."""

    __tablename__ = "opsadv_leases"
    __table_args__ = (UniqueConstraint("device_class", "problem_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_class: Mapped[str] = mapped_column(String(64))
    problem_id: Mapped[int] = mapped_column(ForeignKey("opsadv_problems.id"))
    run_id: Mapped[int] = mapped_column(ForeignKey("opsadv_runs.id"), index=True)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
