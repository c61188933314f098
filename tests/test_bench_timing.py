from flash_gdn.bench.timing import busy_time_us, span_us


def _profile_reporting(events):
    """A stand-in for ``torch.profiler.profile`` (no GPU here) whose sessions report ``events``."""
    class Session:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events

    return Session


def test_busy_time_counts_overlapping_kernels_once():
    assert busy_time_us([]) == 0.0
    assert busy_time_us([(0.0, 1.0), (2.0, 3.0)]) == 2.0          # one after another: the sum
    assert busy_time_us([(4.0, 7.0), (0.0, 5.0), (1.0, 2.0)]) == 7.0  # two streams overlapping
    assert busy_time_us([(0.0, 2.0), (2.0, 3.0)]) == 3.0


def test_span_runs_from_the_first_start_to_the_last_end():
    assert span_us([]) == 0.0
    assert span_us([(2.0, 3.0), (0.0, 1.0)]) == 3.0
    assert span_us([(4.0, 7.0), (0.0, 5.0), (1.0, 2.0)]) == 7.0


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


def test_kernel_timing_detaches_cupti_after_its_profiler_session(monkeypatch):
    # Left attached (Kineto's default), CUPTI slows every launch after the session: the bench's
    # eager times, taken after one, would carry it. A caller's own setting is kept.
    import os

    import torch

    from flash_gdn.bench.timing import kernel_time_ms

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.profiler, "profile", _profile_reporting([]))  # (the session is not what is pinned)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    assert kernel_time_ms(lambda: None, 1) == 0.0
    assert os.environ["TEARDOWN_CUPTI"] == "1"
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    kernel_time_ms(lambda: None, 1)
    assert os.environ["TEARDOWN_CUPTI"] == "0"
    # Below CUDA 12.6 a re-initialisation after graphs can crash (torch's own rule): left alone.
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    kernel_time_ms(lambda: None, 1)
    assert "TEARDOWN_CUPTI" not in os.environ


def test_profiled_run_gives_busy_and_wall_time_of_the_same_calls(monkeypatch):
    # The wall time counts the GPU's idle gaps between kernels (a host that issues slower than the
    # GPU runs); the busy time does not. Both per call, in ms, from the one run's kernel intervals.
    from types import SimpleNamespace

    import torch

    from flash_gdn.bench.timing import profiled_run

    kernels = [(0.0, 40.0), (45.0, 100.0), (130.0, 170.0), (175.0, 230.0)]  # us: two calls of two kernels
    cuda = torch.autograd.DeviceType.CUDA
    events = [SimpleNamespace(device_type=cuda, time_range=SimpleNamespace(start=s), device_time=e - s)
              for s, e in kernels] + [SimpleNamespace(device_type=torch.autograd.DeviceType.CPU)]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.profiler, "profile", _profile_reporting(events))
    run = profiled_run(lambda: None, 2)
    assert abs(run.busy_ms - 0.095) < 1e-12  # (40 + 55 + 40 + 55) us / 2 calls
    assert abs(run.wall_ms - 0.115) < 1e-12  # 230 us / 2 calls
