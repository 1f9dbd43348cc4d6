"""Imported first by the devices' fork server (cluster/launch.py, ``_PRELOAD``): the server dies with its launcher.

multiprocessing's fork server ends when the launcher's end of its pipe closes, but it only looks between
requests: while it is still importing its preloads (seconds on a loaded host), a launcher that is killed
would leave it running. With the kernel's parent-death signal it goes at once, and the devices it forked,
whose own parent-death signal is SIGTERM (``launch._die_with_parent``), stop as they do when the launcher
stops them. Imported anywhere else, it does nothing.
"""
import signal
import sys

if sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules:  # in the fork server, importing its preloads
    from edgetrain.cluster.launch import _set_parent_death_signal

    _set_parent_death_signal(signal.SIGKILL)
