"""The shared format of a calibration's `comm` section (docs/calibration.md): the keys the
all-to-all calibration writes and the cost model reads, for the fast and the slow tests."""

SPEC_KEYS = {"source", "backend", "device", "dtype_bytes", "links", "points"}
LINK_KEYS = {"degree", "latency_s", "bytes_per_s"}
POINT_KEYS = {"degree", "bytes", "seconds"}
