"""Real cluster services for the cluster suites (``make test-cluster``).

PostgreSQL: a throwaway cluster made with ``initdb`` in a temporary directory,
run as the ``postgres`` system user on 127.0.0.1 and a port of its own, and
removed at the end. Every test gets a database of its own.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile

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
