"""A parent that has imported torch and this package once, and forks the tests' command lines from there.

Most of the suite's CPU went to process start-up: every rank of every launch imported torch, `torch._dynamo`
(which torch's optimizers import) and matplotlib, about 3 CPU-seconds a process and 9 a two-rank launch. This
server imports them once per pytest worker; each command the tests run (`python script.py ...`,
`python -m module ...`, `python -m torch.distributed.run ...`) becomes a fork of it that runs the command in
process, with the command's working directory, environment, arguments and exit status. A torchrun command runs
torch's real launcher (its elastic agent, rendezvous, environment variables, error files and failure report); only
its workers are forks of the agent running the script, where torchrun would start `python -u script`.

Protocol (multiprocessing.connection over a Unix socket): the client sends {argv, cwd, env, stdout, stderr,
timeout}; the server forks, waits, and answers {returncode, timed_out, cpu_s}. A command past its timeout is killed with
its whole process group, as subprocess.run's timeout kills its child.

What forking cannot give a command is a fresh interpreter: anything read once at import (an environment variable
read at import time, a different PYTHONPATH) is the server's. tests/launch.py sends such commands to a real
subprocess instead.
"""

from __future__ import annotations

import atexit
import io
import os
import runpy
import signal
import sys
import time
import traceback
from multiprocessing.connection import Listener


def preload() -> None:
    """What every launch would import: torch, its distributed and compiler stacks, plotting, this package."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401  (the loss plot)
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (imported by torch's optimizers when a parameter group is added)
    import torch.distributed.run  # noqa: F401
    import yaml  # noqa: F401

    import parallel_attention.check.__main__  # noqa: F401
    import parallel_attention.training.trainer  # noqa: F401


def exit_code(stop: SystemExit) -> int:
    """The status an interpreter exits with for `sys.exit(code)`."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def run_python(argv: list[str]) -> None:
    """Run `python ARGV` in this process: a script, `-m module` or `-c code` (torchrun's `-u` is dropped)."""
    argv = [a for a in argv if a != "-u"]
    if argv[0] == "-m" and argv[1] == "torch.distributed.run":
        return run_torchrun(argv[2:])
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def worker(*cmd_args: str) -> None:
    """A torchrun worker: what `python -u SCRIPT ARGS` would do, in the forked worker process."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the agent's handlers, inherited by the fork, are not the worker's
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run_python(list(cmd_args))
    except SystemExit as stop:
        code = exit_code(stop)
        if code:
            raise SystemExit(code) from None
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run_torchrun(args: list[str]) -> None:
    """torch.distributed.run's own main, with workers forked from the agent instead of started as interpreters."""
    import torch.distributed.run as torchrun

    config_from_args = torchrun.config_from_args

    def forked_workers(parsed):
        config, cmd, cmd_args = config_from_args(parsed)
        if not isinstance(cmd, str) or os.path.basename(cmd) != os.path.basename(sys.executable):
            raise SystemExit(f"launch_server runs `torchrun script.py` only, not {cmd!r} {cmd_args}")
        config.start_method = "fork"
        return config, worker, cmd_args

    torchrun.config_from_args = forked_workers
    torchrun.main(args)


def unbuffered(fd: int) -> io.TextIOWrapper:
    """A text stream that writes through at once, as `python -u` gives (output survives a kill)."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True, encoding="utf-8",
                            errors="backslashreplace")


def child(request: dict) -> None:
    """The forked command: its own session (one group to kill), directory, environment and output files."""
    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdout, sys.stderr = unbuffered(1), unbuffered(2)
        sys.stdin = open(0, encoding="utf-8", closefd=False)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        atexit._clear()  # the server's exit handlers are not the command's
        try:
            run_python(request["argv"])
            code = 0
        except SystemExit as stop:
            code = exit_code(stop)
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def wait(pid: int, timeout: float) -> tuple[int, bool, float]:
    """(returncode, timed out, CPU seconds of the command and what it reaped): a negative code for a signal, as
    subprocess reports it."""
    deadline = time.monotonic() + timeout
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL, True, 0.0
        time.sleep(0.02)
    try:
        os.killpg(pid, signal.SIGKILL)  # whatever the command left behind (a worker the agent did not reap)
    except ProcessLookupError:
        pass
    return os.waitstatus_to_exitcode(status), False, usage.ru_utime + usage.ru_stime


def serve(address: str) -> None:
    preload()
    with Listener(address, family="AF_UNIX") as listener, listener.accept() as connection:
        connection.send("ready")
        while True:
            try:
                request = connection.recv()
            except EOFError:
                return  # the pytest worker has gone
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                child(request)
            returncode, timed_out, cpu_s = wait(pid, request["timeout"])
            connection.send({"returncode": returncode, "timed_out": timed_out, "cpu_s": cpu_s})


if __name__ == "__main__":
    sys.path.remove(os.path.dirname(os.path.abspath(__file__)))  # tests/ is not on a command's path
    serve(sys.argv[1])
