"""Checking that the requested device class is what the machine or cluster has."""
from __future__ import annotations

from dataclasses import dataclass

from kernel_space import OpsAdvError
from kernel_space._device import KNOWN_CLASSES, RAY_ACCELERATOR, device_class_of
from ops_adv._table import short


class DeviceError(OpsAdvError):
    pass


@dataclass
class Placement:
    accelerator_type: str | None
    local_count: int | None  # GPUs (or measuring slots) found locally; None: ask the cluster

    def count(self) -> int:
        if self.local_count is not None:
            return self.local_count
        import ray

        key = f"accelerator_type:{self.accelerator_type}"
        n = sum(1 for node in ray.nodes() if node.get("Alive") and key in node.get("Resources", {}) for _ in range(int(node["Resources"].get("GPU", 0))))
        if n == 0:
            raise DeviceError(f"the Ray cluster has no {self.accelerator_type} GPU; start nodes with that accelerator or pick another --device")
        return n


def check_device(device: str, on_cluster: bool) -> Placement:
    """Refuse a device class this machine (or cluster) cannot measure, in one line."""
    if device not in KNOWN_CLASSES and not device.replace("-", "").isalnum():
        raise DeviceError(f"unknown device {short(device, 40)}; use one of {', '.join(KNOWN_CLASSES)}")
    if device == "cpu":
        return Placement(None, 1)  # one measuring worker (--workers for more), on a cluster as here
    if device not in KNOWN_CLASSES:
        raise DeviceError(f"unknown device {short(device, 40)}; use one of {', '.join(KNOWN_CLASSES)}")
    accel = RAY_ACCELERATOR.get(device, device.upper())
    if on_cluster:
        return Placement(accel, None)
    import torch

    if not torch.cuda.is_available():
        raise DeviceError(f"--device {device} needs an NVIDIA GPU, and this machine has none; use --device cpu or --ray-address of a cluster with {device} GPUs")
    found = [device_class_of(torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]
    n = sum(1 for c in found if c == device)
    if n == 0:
        raise DeviceError(f"--device {device} does not match this machine's GPU ({', '.join(sorted(set(found)))}); pass --device {found[0]}")
    if n != len(found):
        raise DeviceError(f"this machine mixes GPU classes ({', '.join(found)}); set CUDA_VISIBLE_DEVICES to the {device} GPUs")
    return Placement(None, n)  # checked here; a local Ray node need not advertise the type
