from flash_gdn.bench.timing import busy_time_us


def test_busy_time_counts_overlapping_kernels_once():
    assert busy_time_us([]) == 0.0
    assert busy_time_us([(0.0, 1.0), (2.0, 3.0)]) == 2.0          # one after another: the sum
    assert busy_time_us([(4.0, 7.0), (0.0, 5.0), (1.0, 2.0)]) == 7.0  # two streams overlapping
    assert busy_time_us([(0.0, 2.0), (2.0, 3.0)]) == 3.0


def test_eager_time_is_the_per_call_slope_without_a_runs_fixed_cost():
    from flash_gdn.bench.timing import eager_time_ms

    now = [0.0]

    def clock():
        return now[0]

    def call():  # 2 ms a call
        now[0] += 2e-3

    def sync():  # each synchronisation costs 5 ms: paid once per run, not per call
        now[0] += 5e-3

    assert abs(eager_time_ms(call, 48, sync=sync, clock=clock) - 2.0) < 1e-9
    assert abs(eager_time_ms(call, 8, sync=sync, clock=clock) - (2.0 + 5.0 / 8)) < 1e-9  # short: the plain mean
