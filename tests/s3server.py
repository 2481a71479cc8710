"""A real S3 server for tests: ``moto_server`` in a subprocess on a free local port.

    with S3Server() as s3:
        s3.create_bucket("b")          # boto3 against s3.endpoint
        ... s3://b/prefix with endpoint_url=s3.endpoint ...

Credentials are dummies (moto accepts any); tests put them in the environment (``s3.env``) so
the code under test reads them the way it reads real ones.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, start_timeout_s: float = 30.0) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = dict(CREDENTIALS)
        self._timeout = start_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> "S3Server":
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, **self.env})
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode} before answering")
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                return self
            except urllib.error.HTTPError:
                return self  # it answers, which is all we wait for
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moto_server did not answer on {self.endpoint} within {self._timeout} s")

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"t-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def kill(self) -> None:
        """Stop at once (SIGKILL): what a crashed or unplugged server looks like to clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def s3_in_env():
    """A server for a module's tests, this process's environment pointed at it: its credentials
    set, and none of the variables that would send requests elsewhere or refuse them (an
    endpoint, offline mode)."""
    import pytest

    with pytest.MonkeyPatch.context() as mp, S3Server() as server:
        for k, v in server.env.items():
            mp.setenv(k, v)
        for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT", "DFCACHE_OFFLINE", "HF_HUB_OFFLINE"):
            mp.delenv(k, raising=False)
        yield server
