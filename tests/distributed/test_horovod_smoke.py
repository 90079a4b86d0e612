from tests._support import requires_horovod, run_workers


@requires_horovod
def test_two_process_allreduce_under_horovodrun():
    # The horovodrun command as users type it (the other tests go through kmp's entry).
    results = run_workers("worker_smoke.py", np=2, timeout=240, launcher="horovodrun")
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["size"] == 2
        assert r["sum"] == [3.0, 20.0]  # (0+1) + (1+1), 10 + 10
        assert r["average"] == 0.5
        assert r["gloo"] and r["version"] == "0.28.1"
