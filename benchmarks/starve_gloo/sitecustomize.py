"""Starve torch's gloo threads in every rank: ``bench_clean_exits.py
--starve-gloo`` puts this folder first on ``PYTHONPATH``.

A rank (``RANK`` set) runs on CPU ``STARVE_GLOO_CPU`` only, and a thread of
it scans its threads and moves gloo's worker and I/O threads
(``pt_gloo_runloop``, ``gloo_tcp_loop``) to ``SCHED_IDLE``: with a busy loop
on that CPU they run only in the gaps, as on a heavily loaded machine, where
they finish a collective long after the main thread has moved on. Nothing
else changes; other processes (the launcher) are left alone.
"""
import os
import threading
import time

GLOO_THREADS = ('pt_gloo', 'gloo_tcp')


def _starve_gloo_threads(every_s: float = 0.02) -> None:
    done = set()
    while True:
        for tid in os.listdir('/proc/self/task'):
            if tid in done:
                continue
            try:
                with open(f'/proc/self/task/{tid}/comm') as f:
                    name = f.read().strip()
                if name.startswith(GLOO_THREADS):
                    os.sched_setscheduler(int(tid), os.SCHED_IDLE,
                                          os.sched_param(0))
                    done.add(tid)
            except OSError:
                pass  # the thread ended meanwhile
        time.sleep(every_s)


if os.environ.get('RANK') is not None:
    os.sched_setaffinity(0, {int(os.environ.get('STARVE_GLOO_CPU', '0'))})
    threading.Thread(target=_starve_gloo_threads, daemon=True,
                     name='starve_gloo').start()
