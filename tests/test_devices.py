"""Device classes: what the tuner refuses before measuring anything."""
from __future__ import annotations

import pytest

from kernel_space import get_op
from tuner import TuneOptions, Tuner
from tuner.devices import DeviceError, check_device


def test_cluster_without_that_gpu_class_is_a_clear_error_not_a_hang(ray_session, sqlite_url):
    address = ray_session.get_runtime_context().gcs_address
    opts = TuneOptions(device="h200", problems=[("gemm", get_op("gemm").problem(64, 64, 64, "bf16"))], db_url=sqlite_url,
                       ray_address=address, log=lambda s: None)
    with pytest.raises(DeviceError, match="the Ray cluster has no H200 GPU"):
        Tuner(opts).run()


@pytest.mark.parametrize("device,msg", [("tpu9", "unknown device"), ("h100", "needs an NVIDIA GPU")])
def test_local_device_checks(device, msg):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(DeviceError, match=msg):
        check_device(device, on_cluster=False)
