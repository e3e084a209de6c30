"""The KV-transfer benchmark's mode names: each backend mode three ways, the raw ones apart."""

from benchmarks.kv_modes import BACKEND_MODES, RAW_MODES, backend_of, split_mode


def test_each_backend_mode_is_timed_three_ways() -> None:
    for mode in BACKEND_MODES:
        assert split_mode(mode) == (mode, "all")
        assert split_mode(mode + "_data") == (mode, "data")
        assert split_mode(mode + "_recv") == (mode, "recv")


def test_raw_modes_checks_and_typos_are_not_backend_modes() -> None:
    for mode in (*RAW_MODES, "check", "check_mapped", "ucx_dat", "data", "raw_ucx_data", ""):
        assert split_mode(mode) == ("", "")


def test_the_carrier_of_each_mode() -> None:
    assert backend_of("ucx_per_run_data", "cpu") == ("ucx", False)
    assert backend_of("tcp_recv", "cpu") == ("tcp", False)
    assert backend_of("mapped_recv", "cpu") == ("tcp", True)  # host pools: the TCP carrier idles
    assert backend_of("mapped", "cuda") == ("ucx", True)
    assert backend_of("check", "cpu") == ("ucx", False)
