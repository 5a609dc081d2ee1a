"""Every setting Shoal has, with its default, read from ``SHOAL_*`` variables.

One flat settings object keeps the mapping between a flag and its environment
variable mechanical: ``--pool-size`` is ``SHOAL_POOL_SIZE``. The command line
(:mod:`shoal.cli`) generates its flags from these fields, so a setting is added
here once and is documented in ``shoal serve --help`` for free.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024
# The largest uid a sandbox may run as. One more is (uid_t)-1, which setresuid
# and setpriv read as "leave this id unchanged": for a server running as root,
# a sandbox that stays root.
LAST_UID = 2**32 - 2


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SHOAL_", extra="ignore")

    # -- serving ---------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8080, ge=0, le=65535, description="Port to listen on.")
    data_dir: Path = Field(Path("/var/lib/shoal"), description="Where metadata and files live.")
    database_url: str = Field("", description="Metadata in PostgreSQL rather than the data "
                              "directory's SQLite: 'postgresql://user:password@host/db', or "
                              "'@/path/file' holding it (keeps the password out of ps). "
                              "Front ends sharing one database share containers, uploads and "
                              "runs' records.")
    object_store: str = Field("", description="Tenants' Files API uploads in an S3-compatible "
                              "object store rather than the data directory: 's3://bucket' or "
                              "'s3://bucket/prefix'. Front ends sharing it (and one database) "
                              "serve each other's uploads.")
    object_store_endpoint: str = Field("", description="The object store's URL (e.g. a "
                                       "SeaweedFS or MinIO S3 gateway); empty: AWS S3.")
    object_store_region: str = Field("us-east-1", description="The object store's region.")
    object_store_access_key: str = Field("", description="Access key id for the object store "
                                         "(or '@/path/file'); empty: the AWS_* environment.")
    object_store_secret_key: str = Field("", description="Secret key for the object store, or "
                                         "'@/path/file' holding it.")
    cluster: str = Field("", description="Serve as a cluster front end: route every request to "
                         "the sandbox hosts of a Ray cluster ('auto': the cluster this machine "
                         "is part of; or its address, 'host:6379' or 'ray://host:10001'). Needs "
                         "database_url and object_store; runs no sandbox itself.")
    node_key: str = Field("", description="Set by the cluster on a sandbox host: session and run "
                          "ids start with it, and the containers it holds are placed under it.")
    node_id: str = Field("", description="Set by the cluster on a sandbox host: its Ray node, "
                         "whose slots it reserves for what it holds (shoal.cluster.slots).")
    ray_address: str = Field("", description="Set by the cluster on a sandbox host: the Ray "
                             "cluster (its GCS address) that node is part of.")
    host_idle_seconds: float = Field(660.0, gt=0, description="A cluster front end: how long "
                                     "it waits on a sandbox host that sends nothing, for its "
                                     "answer to begin and between the parts of a streamed one; "
                                     "then the call is a 504 (or its stream is cut) and the "
                                     "connection to that host closed. Longer than anything a "
                                     "host takes in silence: an exec at max_timeout_seconds "
                                     "(300), a model's answer in a gateway turn (the SDKs wait "
                                     "600 s); streams send a keep-alive every "
                                     "stream_ping_seconds.")
    tokens: str = Field("", description="Bearer tokens: 'tok1=tenant-a,tok2=tenant-b', "
                                        "or '@/path/file' with one 'token=tenant' per line. "
                                        "Empty: no authentication.")
    keep_alive_seconds: float = Field(75.0, gt=0, description="How long an idle keep-alive "
                                      "connection stays open (longer than any gateway's pool "
                                      "idle time, so a request never races its closing).")
    request_header_seconds: float = Field(30.0, gt=0, description="A connection that has not "
                                          "sent a request's whole headers this long after it "
                                          "was made, or after the first byte following its "
                                          "previous response, is closed (with a 408 if it "
                                          "began one), like nginx's client_header_timeout: "
                                          "one that sends nothing costs the server a file "
                                          "descriptor and needs no token.")
    max_connections: int = Field(4096, ge=1, description="Client connections open at "
                                 "most: one past it is closed at once, and a request made "
                                 "with this many open (its own among them), or this many "
                                 "requests in progress, is answered 503 and its connection "
                                 "closed. Each is a file descriptor: keep it under the "
                                 "server's open-file limit (raised to its hard limit at "
                                 "start) less what the sandboxes hold (a few each, up to "
                                 "max_sessions) and the upstream connections; shoal check "
                                 "and the start say when it is not. 4096 is far more than "
                                 "max_sessions' calls and a gateway's connection pool need.")
    operator_tokens: str = Field("", description="Tokens of the operator (not of a tenant): "
                                 "'tok1,tok2' or '@/path/file', one per line. They read /metrics "
                                 "and the details of /health; tenants' tokens do not.")
    log_level: str = Field("warning", pattern="^(debug|info|warning|error|critical)$",
                           description="Log level: debug, info, warning, error, critical.")
    shutdown_grace_seconds: float = Field(10.0, ge=0, description="After SIGTERM, how long "
                                          "running calls may take before they are cut (each "
                                          "then answers with what it produced).")
    drain_seconds: float = Field(5.0, ge=0, description="After SIGTERM, how long the server "
                                 "keeps serving while /readyz fails, so load balancers stop "
                                 "sending before the listener closes (at most "
                                 "shutdown_grace_seconds).")

    # -- sessions --------------------------------------------------------------
    max_sessions: int = Field(64, ge=1, description="Live sessions at most; more answer 503.")
    tenant_max_sessions: int = Field(0, ge=0, description="Live sessions (and runs) one tenant "
                                     "may hold; more answer 429. 0: every slot where only one "
                                     "tenant can exist, else half of max_sessions.")
    tenant_max_containers: int = Field(100, ge=1, description="Active containers one tenant "
                                       "may keep; more answer 429.")
    tenant_max_upload_bytes: int = Field(10 * 1024 * MiB, ge=1, description="Bytes one "
                                         "tenant's Files API uploads may add up to; more "
                                         "answer 429.")
    tenant_max_upload_files: int = Field(10_000, ge=1, description="Files one tenant's Files "
                                         "API uploads may number (each is a database row and "
                                         "a stored object, however small); more answer 429.")
    idle_timeout_seconds: int = Field(600, ge=1, description="Default idle timeout.")
    max_idle_timeout_seconds: int = Field(3600, ge=1, description="Ceiling for idle timeout hints.")
    max_lifetime_seconds: int = Field(3600, ge=1, description="Default maximum lifetime.")
    max_lifetime_ceiling_seconds: int = Field(86400, ge=1, description="Ceiling for lifetime hints.")
    reaper_interval_seconds: float = Field(5.0, gt=0, description="How often expired sessions "
                                                                  "are reclaimed.")

    # -- containers ------------------------------------------------------------
    container_ttl_minutes: int = Field(60, ge=1, le=240, description="Default idle TTL of a "
                                                                    "container (1 to 240).")
    container_sandbox_idle_seconds: float = Field(300.0, gt=0, description="An unused container's "
                                                  "sandbox is shut down after this long; its files stay.")
    snapshot_interval_seconds: float = Field(60.0, gt=0, description="With an object store: a "
                                             "live container's files are snapshotted to it at "
                                             "most this often (and whenever its sandbox shuts "
                                             "down), so a host that dies loses at most this much.")

    download_generated: bool = Field(True, description="Whether Zylon's thread endpoint "
                                     "serves generated files (outputs/) for download.")
    download_uploaded: bool = Field(True, description="Whether Zylon's thread endpoint "
                                    "serves uploaded files (uploads/) for download.")

    # -- execution -------------------------------------------------------------
    default_timeout_seconds: int = Field(60, ge=1, description="Timeout of a call that names none.")
    max_timeout_seconds: int = Field(300, ge=1, description="Ceiling a call's timeout is clamped to.")
    output_cap_bytes: int = Field(1 * MiB, ge=1024, description="Cap on each output stream.")
    max_file_bytes: int = Field(50 * MiB, ge=1, description="Largest file accepted or served.")
    request_buffer_mib: int = Field(1024, ge=1, description="Memory all request bodies in "
                                    "progress may hold together; past it a request is "
                                    "answered 503 with Retry-After. With several tenants, "
                                    "one tenant's bodies may hold half of it (at least "
                                    "one body at the cap).")
    request_body_idle_seconds: float = Field(30.0, gt=0, description="A request body that "
                                             "stops arriving for this long is answered 408.")
    response_stall_seconds: float = Field(60.0, gt=0, description="A response its client "
                                          "takes none of for this long (it stays connected "
                                          "but stops reading) is cut and its connection "
                                          "closed, so that what the response streams from "
                                          "(a run's events, a model's turn, a file) is let go.")

    # -- runs and inner tool calls -------------------------------------------------
    run_retention_seconds: int = Field(86400, ge=1, description="How long a finished run's "
                                       "record stays readable (GET /v1/code-execution/runs/ID).")
    tool_wait_seconds: float = Field(300.0, gt=0, description="How long code waits for the "
                                     "result of one inner tool call before the call fails; "
                                     "this wait does not count against the run's timeout.")
    run_log_bytes: int = Field(32 * MiB, ge=MiB, description="Bytes one run's event log "
                               "may hold (its output events and its tool calls' arguments; "
                               "its end always goes in). A tool call that would pass it fails "
                               "in the code with a ToolError, unannounced; output past it is "
                               "left out of the stream (the run's end still carries it).")
    tenant_max_stored_run_bytes: int = Field(1024 * MiB, ge=MiB, description="Bytes one "
                                             "tenant's stored run records (each with its "
                                             "output) may take in the metadata store; past "
                                             "it its oldest are forgotten before their "
                                             "retention ends (GET answers 404 for them).")
    run_logs_kept: int = Field(256, ge=0, description="Finished runs whose event logs stay in "
                               "memory for replay; an older run is replayed from its record "
                               "(its start and its end, with their ids).")
    run_logs_kept_bytes: int = Field(256 * MiB, ge=0, description="Bytes the event logs of "
                                     "finished runs kept for replay may hold together; past "
                                     "it the oldest go first, as past run_logs_kept.")
    stream_ping_seconds: float = Field(15.0, gt=0, description="A server-sent event stream "
                                       "that has had nothing to say this long sends a comment, "
                                       "so that proxies keep an idle connection open.")
    callback_allow: str = Field("", description="Hosts the server may POST programmatic tool "
                                "calls to: 'host', 'host:port', '*.suffix' or a CIDR, "
                                "comma-separated. Empty: no callbacks.")

    # -- gateway mode: the model behind /v1/messages and /v1/responses ------------------
    upstream_anthropic_url: str = Field("", description="Base URL of a model speaking Anthropic's "
                                        "Messages API (Anthropic, or a local server); empty: "
                                        "/v1/messages answers an error.")
    upstream_anthropic_key: str = Field("", description="The operator's key for that upstream, "
                                        "or '@/path/file' holding it. Clients never see it.")
    upstream_anthropic_auth: str = Field("x-api-key", pattern="^(x-api-key|bearer)$",
                                         description="How the key is sent: Anthropic's x-api-key "
                                                     "header, or Authorization: Bearer.")
    upstream_openai_url: str = Field("", description="Base URL of a model speaking OpenAI's "
                                     "Responses API; empty: /v1/responses answers an error.")
    upstream_openai_key: str = Field("", description="The operator's key for that upstream, or "
                                     "'@/path/file' holding it.")
    gateway_max_round_trips: int = Field(10, ge=1, le=100, description="Sandbox round trips one "
                                         "gateway request may make before it pauses "
                                         "(pause_turn); the client's next request continues.")
    gateway_paused_bytes: int = Field(256 * MiB, ge=0, description="Bytes the paused "
                                      "/v1/responses kept in memory may hold together (each "
                                      "its conversation, for a client that answers with the "
                                      "full input instead of previous_response_id); one "
                                      "tenant's hold half. Past it the oldest are forgotten.")
    tenant_max_gateway_requests: int = Field(32, ge=0, description="Gateway requests "
                                             "(/v1/messages, /v1/responses, pass-through too) "
                                             "one tenant may have in flight; more answer 429. "
                                             "0: no limit.")
    upstream_max_connections: int = Field(512, ge=1, description="Connections to the "
                                          "upstream models at most, for every tenant; a call "
                                          "that waits 10 s for one answers 503.")
    skills_dir: Path | None = Field(None, description="Folder of skills, one folder each; a "
                                    "request's container.skills chooses which are mounted "
                                    "read-only under /mnt/skills/.")
    response_retention_seconds: int = Field(7 * 86400, ge=1, description="How long stored "
                                            "/v1/responses objects stay readable (for "
                                            "previous_response_id).")
    tenant_max_stored_response_bytes: int = Field(
        1024 * MiB, ge=1, description="Bytes of stored /v1/responses objects (each holds its "
        "conversation so far) one tenant may keep; past it a request that would store one is "
        "a 429 until some are deleted or age out.")

    # -- egress: what sandboxes may reach, through the host's broker -------------------
    egress_allow: str = Field("", description="Where any sandbox may connect, through the "
                              "host's proxy: 'host' (ports 80, 443), 'host:port', '*.suffix', "
                              "an IP, or a CIDR, comma-separated. Private, loopback and "
                              "link-local addresses only where named literally. A container's "
                              "network_policy can only narrow it. Empty: nothing.")
    egress_max_connections: int = Field(32, ge=1, description="Connections one sandbox may "
                                        "hold open through the proxy at once.")
    egress_bytes_per_second: int = Field(64 * MiB, ge=1, description="Bytes one sandbox may "
                                         "move through the proxy per second, both ways "
                                         "together (bursts of a second's worth).")
    model_access: bool = Field(True, description="Whether code run by /v1/messages and "
                               "/v1/responses may call the model API itself (with a short-"
                               "lived token of the request's tenant; the operator's key stays "
                               "on the host). Needs an upstream.")
    model_token_seconds: int = Field(900, ge=1, description="How long a sandbox's model "
                                     "token lasts.")
    model_token_requests: int = Field(50, ge=1, description="How many model API requests one "
                                      "sandbox token allows.")

    # -- the sandbox -----------------------------------------------------------
    launcher: str = Field("zygote", pattern="^(bwrap|zygote)$",
                          description="How sandboxes start: 'zygote' (forked from one process "
                                      "with the preloaded modules imported, sharing their "
                                      "memory; bubblewrap where it cannot run) or 'bwrap' (a "
                                      "bubblewrap process each).")
    zygote_spawn_seconds: float = Field(30.0, ge=12, description="How long a launch waits for "
                                        "the zygote's answer. A zygote that has answered "
                                        "nothing at all in that time (stopped, deadlocked, its "
                                        "builder hung) is replaced, as a dead one is, and the "
                                        "sandboxes it forked die with it. At least 12 s: a "
                                        "healthy zygote answers within its builder's 10 s "
                                        "deadline for a sandbox's walls, however busy.")
    pool_size: int = Field(4, ge=0, description="Warm sandboxes kept ready to lease.")
    pool_max: int = Field(32, ge=0, description="How far the warm pool grows past pool_size "
                          "while leases outrun it (a burst); it shrinks back when they stop.")
    launch_concurrency: int = Field(8, ge=1, description="Sandboxes started at once. Most of a "
                                    "start is waiting on the kernel (cgroup attach, new "
                                    "namespaces), so several overlap well even on two cores.")
    launch_queue: int = Field(64, ge=1, description="Leases that may wait for a sandbox to "
                              "start when none is warm; more answer 503 with Retry-After at "
                              "once rather than queue without bound.")
    preload_modules: str = Field("numpy,pandas,matplotlib.pyplot",
                                 description="Modules imported in every warm sandbox before it "
                                             "is leased (matplotlib with the Agg backend).")
    cgroup_favor_dynmods: bool = Field(True, description="Set cgroup2's favordynmods on "
                                       "the host at start (Linux 6.0+): a sandbox's move into "
                                       "its cgroups then costs well under a millisecond instead "
                                       "of an RCU grace period (8-20 ms), which launches in a "
                                       "burst queue behind; forks and exits host-wide take a "
                                       "slightly slower path. It stays set until reboot.")
    memory_limit_mib: int = Field(1024, ge=16, description="Memory limit per sandbox.")
    max_memory_limit_mib: int = Field(4096, ge=16, description="The largest memory_limit tier "
                                      "(1g, 4g, 16g, 64g) a container may ask for; larger ones "
                                      "are refused.")
    pids_limit: int = Field(256, ge=8, description="Processes and threads per sandbox.")
    cpu_limit: float = Field(1.0, gt=0, description="CPU cores per sandbox (a CFS quota).")
    tmp_size_mib: int = Field(256, ge=1, description="Size of the sandbox's /tmp and /dev/shm.")
    disk_limit_mib: int = Field(1024, ge=16, description="Disk quota of a session's or "
                                                         "container's files (an ext4 volume).")
    uid_base: int = Field(200000, ge=1000, le=LAST_UID, description="First uid handed to "
                          "sandboxes (1000 or more, so never root or a system account).")
    uid_count: int = Field(4096, ge=1, description="How many uids sandboxes may use.")
    uid_lock_dir: Path = Field(Path("/run/shoal-uids"), description="Where uid leases are "
                               "held (one lock file per uid). The same for every server on the "
                               "host, whatever its run directory, so no two sandboxes of any "
                               "server ever share a uid.")
    runtime_dir: Path = Field(Path("/var/cache/shoal/runtime"),
                              description="Cache of built runtime environments.")
    run_dir: Path = Field(Path("/run/shoal"), description="Per-sandbox scratch directories.")

    @field_validator("log_level", "launcher", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    # The callback hosts are the same kind of entries, matched by the same code
    # (shoal.runs.broker.check_callback_url): one that cannot be understood is
    # an error at start, not on every run that names a callback.
    @field_validator("egress_allow", "callback_allow")
    @classmethod
    def _check_allowlist(cls, value: str) -> str:
        from .egress.policy import Allowlist, PolicyError

        try:
            Allowlist(value)
        except PolicyError as exc:
            raise ValueError(f"{exc} (entries: host, host:port, *.suffix, an IP or a CIDR)") \
                from None
        return value

    @model_validator(mode="after")
    def _check_uid_range(self) -> "Settings":
        last = self.uid_base + self.uid_count - 1
        if last > LAST_UID:
            raise ValueError(f"the sandbox uids (uid_base {self.uid_base}, uid_count "
                             f"{self.uid_count}) run to {last}, past {LAST_UID}, the largest "
                             "uid ((uid_t)-1 means 'unchanged' to setresuid)")
        return self

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str) -> str:
        url = value.strip()
        if url and not url.startswith("@") and not url.startswith(("postgresql://",
                                                                    "postgres://")):
            raise ValueError("a database URL is postgresql://user:password@host[:port]/database "
                             "(or '@/path/file' holding one)")
        return url

    # Else the server starts, and every gateway call is a 502 naming httpx's
    # complaint ("missing an 'http://' or 'https://' protocol") to the client.
    @field_validator("upstream_anthropic_url", "upstream_openai_url")
    @classmethod
    def _check_upstream_url(cls, value: str) -> str:
        url = value.strip()
        if not url:
            return url
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises for a port that is not a number in range
        except ValueError:
            parts = None
        if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
                or any(char.isspace() or ord(char) < 32 for char in url)):
            raise ValueError("an upstream is an http:// or https:// URL, e.g. "
                             "https://api.anthropic.com")
        return url

    @field_validator("object_store")
    @classmethod
    def _check_object_store(cls, value: str) -> str:
        url = value.strip()
        if url and (not url.startswith("s3://") or not url[5:].split("/", 1)[0]):
            raise ValueError("an object store is s3://bucket or s3://bucket/prefix")
        return url

    @field_validator("preload_modules")
    @classmethod
    def _strip_modules(cls, value: str) -> str:
        return ",".join(part.strip() for part in value.split(",") if part.strip())

    @property
    def model_upstream(self) -> bool:
        """Whether sandboxes get the model API (see model_access)."""
        return self.model_access and bool(self.upstream_anthropic_url or self.upstream_openai_url)

    @property
    def request_cap(self) -> int:
        """The largest request body: a file as large as any accepted, base64 in
        JSON (4/3 of its size), and a margin for the rest of the request."""
        return self.max_file_bytes * 4 // 3 + MiB

    @property
    def egress_enabled(self) -> bool:
        """Whether sandboxes get the relay and the broker at all."""
        return bool(self.egress_allow.strip()) or self.model_upstream

    def object_store_config(self) -> dict | None:
        """The object store's settings, secrets read (``@file``); None: no store."""
        if not self.object_store:
            return None
        return {"url": self.object_store, "endpoint": self.object_store_endpoint,
                "region": self.object_store_region,
                "access_key": read_secret(self.object_store_access_key),
                "secret_key": read_secret(self.object_store_secret_key)}

    @property
    def preload(self) -> list[str]:
        return [name for name in self.preload_modules.split(",") if name]


def read_secret(setting: str) -> str:
    """A secret given inline or as '@/path/file' (the file holding it alone), so it
    need not appear on a command line (and in ``ps``)."""
    setting = setting.strip()
    where = "the value"
    if setting.startswith("@"):
        path = Path(setting[1:])
        where = str(path)
        try:
            setting = path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    # A secret goes out in a header: one with a line break in it (a file with a
    # comment line, or two keys) cannot be sent, and httpx's refusal quotes the
    # header, secret and all, in an error every client of the gateway was shown.
    if any(ord(char) < 32 or ord(char) == 127 for char in setting):
        raise ValueError(f"{where} holds more than one line or a control character "
                         "(the secret alone, on one line, is expected)")
    return setting
