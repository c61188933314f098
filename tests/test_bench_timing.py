from flash_gdn.bench.timing import busy_time_us


def test_busy_time_counts_overlapping_kernels_once():
    assert busy_time_us([]) == 0.0
    assert busy_time_us([(0.0, 1.0), (2.0, 3.0)]) == 2.0          # one after another: the sum
    assert busy_time_us([(4.0, 7.0), (0.0, 5.0), (1.0, 2.0)]) == 7.0  # two streams overlapping
    assert busy_time_us([(0.0, 2.0), (2.0, 3.0)]) == 3.0
