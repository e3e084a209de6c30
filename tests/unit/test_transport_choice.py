"""The KV transport a worker may use on its device (pure: ucxx's presence is passed in)."""

import pytest

from kv_transfer.transport_choice import check_backend_for_device, resolve_backend


@pytest.mark.parametrize("name", ["auto", "ucx", "tcp"])
@pytest.mark.parametrize("ucx", [True, False])
def test_host_pools_take_any_transport(name: str, ucx: bool) -> None:
    check_backend_for_device(name, "cpu", ucx)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_cuda_pool_refuses_tcp(device: str) -> None:
    with pytest.raises(ValueError, match="host .CPU. KV pools only"):
        check_backend_for_device("tcp", device, True)


@pytest.mark.parametrize("name", ["auto", "ucx"])
def test_a_cuda_pool_without_ucxx_is_refused_with_the_fix(name: str) -> None:
    with pytest.raises(ValueError, match="ucxx is not installed.*pip install ucxx-cu13"):
        check_backend_for_device(name, "cuda:0", False)


@pytest.mark.parametrize("name", ["auto", "ucx"])
def test_a_cuda_pool_with_ucxx_passes(name: str) -> None:
    check_backend_for_device(name, "cuda", True)


def test_unknown_transport_is_named() -> None:
    with pytest.raises(ValueError, match="unknown KV transfer backend 'rdma'"):
        resolve_backend("rdma")
