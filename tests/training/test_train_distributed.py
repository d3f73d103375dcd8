"""Where each training process computes and how processes join: gloo on the CPU, NCCL between GPUs."""

import pytest
import torch

from train.config import TrainConfig
from train.distributed import DistributedContext, process_group_backend, rank_device


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), (torch.device("cpu"), "gloo"), ("cuda:0", "nccl"),
                                             (torch.device("cuda", 3), "nccl")])
def test_the_backend_follows_the_device(device, backend):
    assert process_group_backend(device) == backend


def test_each_process_takes_the_gpu_of_its_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert [rank_device("cuda", rank) for rank in range(8)] == [torch.device("cuda", rank) for rank in range(8)]
    assert rank_device("cpu", 5) == torch.device("cpu")
    with pytest.raises(ValueError, match="LOCAL_RANK = 8 has no GPU of its own, the host has 8"):
        rank_device("cuda", 8)


def test_cuda_without_a_gpu_and_unknown_devices_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="TrainConfig.device = 'cuda' but torch finds no CUDA device"):
        rank_device("cuda", 0)
    with pytest.raises(ValueError, match="TrainConfig.device must be one of \\('cpu', 'cuda'\\), got 'tpu'"):
        rank_device("tpu", 0)
    with pytest.raises(ValueError, match="TrainConfig.device must be one of \\('cpu', 'cuda'\\), got 'gpu'"):
        TrainConfig(device="gpu")


def test_one_cpu_process_needs_no_process_group(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    context = DistributedContext()
    assert (context.world_size, context.rank, context.device) == (1, 0, torch.device("cpu"))
    assert not context.initialized_here and not torch.distributed.is_initialized()
    assert TrainConfig().device == "cpu"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torchrun_processes_join_with_the_device_backend(monkeypatch, device):
    """Under torchrun (WORLD_SIZE 2, this process LOCAL_RANK 1) the process group is gloo on the CPU and
    NCCL bound to the process's own GPU with ``--device cuda`` (process-group calls recorded, not made)."""
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kwargs: calls.append(("init", kwargs)))
    context = DistributedContext(device=device)
    if device == "cpu":
        assert calls == [("init", {"backend": "gloo"})]
    else:
        gpu = torch.device("cuda", 1)
        assert calls == [("set_device", gpu), ("init", {"backend": "nccl", "device_id": gpu})]
    assert context.device == (torch.device("cuda", 1) if device == "cuda" else torch.device("cpu"))
    assert context.initialized_here and context.my_share(list(range(5))) == [1, 3]
