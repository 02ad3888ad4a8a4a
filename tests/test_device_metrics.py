"""Device memory in the logged metrics: the peak's share of the device's limit, and one warning per run above
90 % (a stand-in device answers memory_stats as a TPU does; on CPU JAX reports none)."""

import warnings

import pytest

from posttrain.train import metrics as M


class Device:
    def __init__(self, in_use, peak, limit):
        self.stats = {"bytes_in_use": in_use, "peak_bytes_in_use": peak, "bytes_limit": limit}

    def memory_stats(self):
        return self.stats


def test_memory_share_and_one_warning_above_90_percent():
    low = M.memory_stats(Device(50, 80, 100))
    assert low == {"device_bytes_in_use": 50, "device_peak_bytes": 80, "device_memory_frac": 0.8}
    warn = M.MemoryWarning()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn(low)  # 80 %: quiet
    high = M.memory_stats(Device(60, 95, 100))
    with pytest.warns(UserWarning, match="95% of the device's limit"):
        assert warn(high)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn(high)  # once per run
        assert not M.MemoryWarning()({"host_rss_bytes": 10})  # CPU: no device share, no warning
