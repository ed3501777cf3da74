"""GracefulStop: the first SIGINT / SIGTERM stops once (at once, or deferred while unsafe), later ones are
reported and ignored, the old handlers come back, the exit status is 128 + the signal."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from experiments.signals import GracefulStop, StopRequested


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_first_signal_raises_where_the_main_thread_is(signum, code):
    with pytest.raises(StopRequested), GracefulStop() as stop:
        os.kill(os.getpid(), signum)
        for _ in range(1000):  # the handler runs between bytecodes
            pass
        pytest.fail("the signal did not interrupt")
    assert stop.requested == signum and stop.exit_code == code


def test_signal_while_unsafe_waits_for_check_and_later_signals_are_ignored():
    out = io.StringIO()
    with GracefulStop(can_interrupt=lambda: False, stream=out) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # while "saving": reported, ignored
        assert stop.requested == signal.SIGTERM
        with pytest.raises(StopRequested):
            stop.check()
        stop.check()  # raised once only
    assert "stopping after the current update" in out.getvalue()
    assert "SIGINT: already stopping" in out.getvalue()
    assert stop.exit_code == 143


def test_no_signal_check_passes_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with GracefulStop() as stop:
        stop.check()
        assert signal.getsignal(signal.SIGINT) != before[0]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert stop.requested is None and stop.exit_code == 0


def test_a_second_signal_cannot_interrupt_the_cleanup_in_another_process(tmp_path):
    """The pattern run.py uses, in a real process: signal, then a second one during the 'save'."""
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from experiments.signals import GracefulStop, StopRequested
        with GracefulStop() as stop:
            try:
                print("ready", flush=True)
                time.sleep(60)
            except StopRequested:
                print("saving", flush=True)
                time.sleep(1.0)  # the second signal arrives here
                open({str(tmp_path / "saved")!r}, "w").write("ok")
        sys.exit(stop.exit_code)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGTERM)
    assert process.stdout.readline() == "saving\n"
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 143
    assert (tmp_path / "saved").read_text() == "ok"
    assert "SIGINT: already stopping" in process.stderr.read()
