"""Single-process `python pretrain_gpt.py ...` runs forked from a process that has
imported torch, megatron-core and the trainer once, instead of a fresh interpreter each.

A fresh interpreter spends about 2.5 s of CPU importing before it parses a flag, most of
a short test run; the suite starts dozens. `start(argv)` asks this worker's server (one
per pytest process, started on first use) to fork a child that runs the script as
`python SCRIPT ARGV` would: its own pid (signals and psutil reach it), stdout/stderr on
pipes the caller owns, stdin /dev/null, the caller's environment, working directory and
argv, default signal dispositions, a process group (or optionally a session) of its
own, and the interpreter's normal exit (non-daemon threads joined, atexit handlers run,
an uncaught exception printed with exit code 1). The server has run nothing but imports, so the child
starts as clean as a new interpreter, minus the import time.

The tests of what users launch through torchrun, and of importing itself, still start real
interpreters (tests/distributed.py `start_pretrain` with world_size > 1).

    python tests/forked_cli.py SOCKET   # the server (started by `start`)
"""

import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# --- the server ---------------------------------------------------------------------

def _serve(path):
    """Accept requests until stdin closes (the pytest process ended); fork a child per
    request and report its pid, then its wait status. Returns the request in the child."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select below
    print("ready", flush=True)
    waiting = {}  # pid -> the connection to report its exit on
    while True:
        readable, _, _ = select.select([listener, wake_read, sys.stdin], [], [])
        if sys.stdin in readable and not sys.stdin.buffer.read1(1):
            return None  # the pytest process is gone: so are we
        if wake_read in readable:
            os.read(wake_read, 512)
            while waiting:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                connection = waiting.pop(pid, None)
                if connection is not None:
                    _send_line(connection, f"exit {status}")
                    connection.close()
        if listener in readable:
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:  # the child: leave the server's loop with the request
                signal.set_wakeup_fd(-1)
                for handle in [listener, *waiting.values()]:
                    handle.close()
                os.close(wake_read)
                os.close(wake_write)
                request["fds"] = fds
                connection.close()
                return request
            for fd in fds:
                os.close(fd)
            waiting[pid] = connection
            _send_line(connection, f"pid {pid}")


def _send_line(connection, text):
    try:
        connection.sendall(text.encode() + b"\n")
    except OSError:
        pass  # the caller went away; the child still ran to its end


def _become(request):
    """Turn the forked child into `python SCRIPT ARGV` in the caller's environment."""
    import warnings

    # the server froze its imports' objects (gc.freeze: its forks copy fewer pages); a
    # fresh interpreter collects them at exit, which extensions rely on (triton's
    # nanobind module prints "leaked N instances" to stderr otherwise)
    gc.unfreeze()
    stdin, stdout, stderr = request["fds"]
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    if request["new_session"]:
        os.setsid()
    else:  # a process group of its own, so kill_tree ends it and all it forked at once
        os.setpgid(0, 0)
    for number in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    warnings.resetwarnings()
    for option in filter(None, os.environ.get("PYTHONWARNINGS", "").split(",")):
        warnings._setoption(option)
    if "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # the interpreter's own streams: stdout block-buffered on a pipe, stderr line-buffered
    # with backslashreplace, both written through under PYTHONUNBUFFERED
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", buffering=1 if unbuffered or os.isatty(1) else -1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    if unbuffered:
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)
    script = os.path.join(request["cwd"], request["argv"][0])
    sys.argv = [script] + request["argv"][1:]
    sys.path[0] = os.path.dirname(script)
    import runpy

    runpy.run_path(script, run_name="__main__")


def _preimport():
    """What every run imports (and what it imports on first use), once."""
    import importlib

    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    import dist_runner  # torch, megatron-core, the trainer, pretrain_gpt

    for name in dist_runner.FIRST_USE:
        importlib.import_module(name)
    gc.freeze()


# --- the caller's side ----------------------------------------------------------------

class ForkedProcess:
    """What the tests use of `subprocess.Popen` (text mode), for a child of the server."""

    def __init__(self, args, connection, stdout, stderr):
        self.args = args
        self._connection, self._received = connection, b""
        self.returncode = None
        self._status_lock = threading.Lock()
        self.pid = int(self._read_line("pid", None))
        self.stdout, self.stderr = stdout, stderr

    def _read_line(self, key, timeout):
        """The server's next `KEY VALUE` line; None if none came within `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._received:
            left = None if deadline is None else max(0, deadline - time.monotonic())
            if not select.select([self._connection], [], [], left)[0]:
                return None
            chunk = self._connection.recv(4096)
            if not chunk:
                raise RuntimeError(f"forked_cli server closed the connection before {key!r}")
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        words = line.decode().split()
        if len(words) != 2 or words[0] != key:
            raise RuntimeError(f"forked_cli server: expected {key!r}, got {words!r}")
        return words[1]

    def _finish(self, timeout):
        with self._status_lock:
            if self.returncode is None:
                status = self._read_line("exit", timeout)
                if status is not None:
                    self.returncode = os.waitstatus_to_exitcode(int(status))
                    self._connection.close()
        return self.returncode

    def poll(self):
        return self._finish(0)

    def wait(self, timeout=None):
        if self._finish(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout=None):
        """(stdout, stderr) to their ends, as Popen.communicate (both read at once)."""
        outputs = {}

        def read(name, stream):
            outputs[name] = stream.read() if stream is not None and not stream.closed else ""

        readers = [threading.Thread(target=read, args=(name, stream), daemon=True)
                   for name, stream in (("stdout", self.stdout), ("stderr", self.stderr))]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0, deadline - time.monotonic()))
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return outputs["stdout"], outputs["stderr"]

    def send_signal(self, number):
        if self.returncode is None:
            os.kill(self.pid, number)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


_server = None  # (Popen of the server, socket path) of this process
_server_lock = threading.Lock()


def _server_socket():
    global _server
    with _server_lock:
        if _server is None or _server[0].poll() is not None:
            import tempfile

            path = os.path.join(tempfile.mkdtemp(prefix="forked_cli_"), "socket")
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            server = subprocess.Popen([sys.executable, os.path.abspath(__file__), path],
                                      cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError("forked_cli server did not start")
            _server = server, path
            import atexit

            atexit.register(_stop_server, server, path)
        return _server[1]


def _stop_server(server, socket_path):
    """At this process's exit: the server sees its stdin close and ends; waiting for it
    reaps it (its CPU and its children's count in ours, as a subprocess's would). Its
    socket's temporary directory goes with it."""
    server.stdin.close()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    import shutil

    shutil.rmtree(os.path.dirname(socket_path), ignore_errors=True)


def start(argv, env, cwd=ROOT, new_session=False):
    """`python ARGV[0] ARGV[1:]` as a child of this worker's server; ARGV[0] is a script
    path relative to `cwd`. Returns a `ForkedProcess` with text pipes on stdout/stderr."""
    tripwire = sys.modules.get("conftest")  # a test without the `distributed` marker
    if tripwire is not None and hasattr(tripwire, "check_process_start"):
        tripwire.check_process_start(" ".join(map(str, argv))[:200])
    if env.get("PYTHONPATH") != os.environ.get("PYTHONPATH"):
        # the server's imports did not see that path: a fresh interpreter must
        return subprocess.Popen([sys.executable] + list(argv), cwd=cwd, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                start_new_session=new_session)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(_server_socket())
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    request = {"argv": list(argv), "env": dict(env), "cwd": str(cwd),
               "new_session": new_session}
    try:
        socket.send_fds(connection, [json.dumps(request).encode()],
                        [null, out_write, err_write])
    finally:
        for fd in (null, out_write, err_write):
            os.close(fd)
    return ForkedProcess([sys.executable] + list(argv), connection,
                         os.fdopen(out_read, "r"), os.fdopen(err_read, "r"))


def run(argv, env, cwd=ROOT, timeout=None):
    """`subprocess.run([python] + argv, capture_output=True, text=True)`, forked."""
    process = start(argv, env, cwd)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


if __name__ == "__main__":
    _preimport()
    _request = _serve(sys.argv[1])
    if _request is not None:
        _become(_request)
