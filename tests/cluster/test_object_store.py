"""Uploads in an S3-compatible object store: ``shoal serve --object-store``.

Real front ends, a real PostgreSQL and a real SeaweedFS S3 gateway. An upload is
in the bucket, byte for byte, when the Files API acknowledges it; a second
front end on the same database and bucket serves it, hands it to a run's
sandbox, and deletes it for both. A store that cannot be used stops the server
at start-up in one line.
"""

from __future__ import annotations

import hashlib
import json
import subprocess

import httpx
import openai
import pytest

from tests.serving import SHOAL, free_port

from .conftest import object_store_front_end

pytestmark = pytest.mark.cluster


def _front_end(tmp_path, name, uid_base, postgres_url, seaweedfs, bucket):
    return object_store_front_end(tmp_path, name, uid_base, postgres_url, seaweedfs, bucket,
                                  pool_size=1)


def _objects(seaweedfs, bucket) -> dict[str, bytes]:
    """The bucket's uploads (containers' snapshots are test_container_snapshots.py's)."""
    s3 = seaweedfs.client()
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="shoal/uploads/").get("Contents", [])
    return {item["Key"]: s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
            for item in listed}


def test_an_acknowledged_upload_is_in_the_bucket_and_every_front_end_serves_it(
        postgres_url, seaweedfs, tmp_path):
    bucket = seaweedfs.new_bucket()
    first = _front_end(tmp_path, "a", 963_000, postgres_url, seaweedfs, bucket)
    second = _front_end(tmp_path, "b", 964_000, postgres_url, seaweedfs, bucket)
    try:
        one = openai.OpenAI(base_url=f"{first.url}/v1", api_key="none", max_retries=0)
        two = openai.OpenAI(base_url=f"{second.url}/v1", api_key="none", max_retries=0)
        body = b"month,revenue\njan,10\nfeb,32\n" + bytes(range(256)) * 4096  # 1 MiB and more
        uploaded = one.files.create(file=("sales.csv", body), purpose="user_data")
        # Acknowledged: it is in the bucket, under a key of hashes, and not on disk.
        objects = _objects(seaweedfs, bucket)
        assert list(objects.values()) == [body]
        (key,) = objects
        assert key.startswith("shoal/uploads/") and "sales" not in key and uploaded.id not in key
        assert [f.name for f in (first.data_dir / "uploads").rglob("*") if f.is_file()] == []

        # The other front end has it: its record (the database) and its bytes (the bucket).
        assert two.files.retrieve(uploaded.id).bytes == len(body)
        assert two.files.content(uploaded.id).read() == body
        # A run there gets it in its sandbox.
        with httpx.Client(base_url=second.url, timeout=120) as http:
            with http.stream("POST", "/v1/code-execution/runs", json={
                    "code": "import hashlib\n"
                            "print(hashlib.sha256(open('external-files/sales.csv', 'rb')"
                            ".read()).hexdigest())",
                    "file_ids": [uploaded.id]}) as events:
                completed = [json.loads(line[5:]) for line in events.iter_lines()
                             if line.startswith("data:") and "stdout" in line]
        assert completed[-1]["stdout"] == hashlib.sha256(body).hexdigest() + "\n", completed

        # Deleted through one front end: gone from the bucket and for the other.
        assert two.files.delete(uploaded.id).deleted is True
        assert _objects(seaweedfs, bucket) == {}
        with pytest.raises(openai.NotFoundError):
            one.files.content(uploaded.id)
    finally:
        first.stop()
        second.stop()


def test_an_object_store_that_cannot_be_used_is_one_line_at_start_up(seaweedfs, tmp_path):
    bucket = seaweedfs.new_bucket()

    def refused(*flags: str) -> str:
        done = subprocess.run([str(SHOAL), "serve", "--port", str(free_port()), "--data-dir",
                               str(tmp_path), "--object-store-endpoint", seaweedfs.endpoint,
                               "--object-store-access-key", seaweedfs.ACCESS_KEY, *flags],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and "serving on" not in done.stderr, done.stderr
        return done.stderr

    wrong_key = refused("--object-store", f"s3://{bucket}", "--object-store-secret-key", "wrong")
    assert f"cannot use the object store s3://{bucket}" in wrong_key, wrong_key
    missing = refused("--object-store", "s3://no-such-bucket",
                      "--object-store-secret-key", seaweedfs.secret_key)
    assert "no such bucket" in missing, missing
    assert seaweedfs.secret_key not in missing
    assert "an object store is s3://bucket" in refused("--object-store", "gs://elsewhere")
