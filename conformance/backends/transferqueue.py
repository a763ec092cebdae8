"""TransferQueue 0.1.11 as an rlconform transport: its KV API, with SimpleStorage or MooncakeStore.

The adapter is deliberately thin, so that the clauses judge TransferQueue and not the adapter:
- put -> `kv_batch_put(keys, partition_id, fields=TensorDict, tags)`, get -> `kv_batch_get` for
  the columns plus the controller's per-key metadata (`kv_retrieve_meta`) for the tags,
  list -> `kv_list`, clear -> `kv_clear` or the client's `clear_partition`;
- the one thing it adds is a layout record: put stores `["dense", row_shape]` or `["jagged"]`
  per field in each key's tags (under LAYOUT_TAG), because TransferQueue hands dense columns
  of two or more dims back as jagged nested tensors. get restacks a column only when every
  row's record says dense and every row has the recorded shape; anything else is returned as
  the library gave it, so a shape defect (e.g. (1,) rows for a 1-D column) still fails;
- library errors that mean "not there" (ValueError "keys or partition were not found",
  "fields are not ready") become KeyError naming what was asked; a shorter or empty result
  is passed through untouched (that is a TransferQueue defect, waived in expectations/);
- every call runs on the client's event loop with a timeout (RLCONFORM_TQ_TIMEOUT_S, 60 s),
  because a dead SimpleStorage unit is reported only after 3 attempts x 200 s
  (TQ_SIMPLE_STORAGE_MAX_ATTEMPTS, TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT) and a dead Mooncake
  master blocks the client's event loop inside a synchronous store call.
Each transport instance writes under its own namespace (`<ns>/<partition>`), so a fresh
instance is a fresh store although TransferQueue is one global store per Ray cluster; pass
`namespace=` to share partitions between instances (a rollout process and a trainer).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import os
import tempfile
import uuid
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from rlconform.conformance.backend import Backend, package_version
from rlconform.conformance.backends import _procs
from rlconform.conformance.catalogue import CLAUSES
from rlconform.reference_impl.dataplane import check_get, check_name, check_names, check_tags

LAYOUT_TAG = "__rlconform_layout__:"
DEFAULT_TIMEOUT_S = float(os.environ.get("RLCONFORM_TQ_TIMEOUT_S", "60"))
CAPABILITIES = {"partitions", "bfloat16"}
_NOT_FOUND = "keys or partition were not found"
_NOT_READY = "fields are not ready"


def _tq():
    try:
        import transfer_queue
    except ImportError as exc:
        raise ImportError("the transferqueue backends need `pip install TransferQueue==0.1.11 "
                          "tensordict ray`") from exc
    return transfer_queue


def _is_layout_record(key) -> bool:
    return isinstance(key, str) and key.startswith(LAYOUT_TAG)  # tag keys may be ints


def _layout_record(col) -> list:
    return ["jagged"] if col.is_nested else ["dense", list(col.shape[1:])]


def _restore(col, records: list):
    """Restack a column TransferQueue returned jagged if, and only if, put recorded it dense."""
    import torch

    if not col.is_nested or not records or any(r is None or r[0] != "dense" for r in records):
        return col
    shape = records[0][1]
    if any(r[1] != shape for r in records):
        return col
    rows = col.unbind()
    if any(list(r.shape) != shape for r in rows):
        return col  # not what was written: let the layout clause see the library's rows
    return torch.stack(rows)


class TransferQueueTransport:
    """The rlconform transport surface over TransferQueue's KV API (see the module docstring)."""

    def __init__(self, namespace: str | None = None, timeout_s: float | None = None,
                 address: dict | None = None):
        self._tq = _tq()
        if address is not None:  # a rank process: join the driver's Ray cluster and store
            namespace = _join(address)
        try:
            self._client = self._tq.get_client()
        except AssertionError as exc:
            raise RuntimeError("TransferQueue is not initialised: enter the backend's session "
                               "(Backend.session) before making a transport") from exc
        self._owns_namespace = namespace is None
        self._ns = namespace or f"rlc-{uuid.uuid4().hex[:10]}"
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self._written: set[str] = set()
        self._wedged = False  # a call timed out: the store is gone, skip cleanup calls
        self._closed = False

    def address(self) -> dict:
        """Where another process reopens this store: the Ray cluster and this namespace
        (capability `multiprocess`; `TransferQueueTransport(address=...)` there)."""
        import ray

        return {"ray": ray.get_runtime_context().gcs_address, "namespace": self._ns}

    # -- plumbing ---------------------------------------------------------------------------
    def _pid(self, partition: str) -> str:
        return f"{self._ns}/{partition}"

    def _call(self, coro, what: str):
        """Run a TransferQueue coroutine on its client loop; give up after the timeout."""
        if self._closed:
            coro.close()
            raise RuntimeError("transport is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self._client._loop)
        try:
            return fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            self._wedged = True
            if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
                with contextlib.suppress(Exception):  # the wedged loop never started it
                    coro.close()
            raise _procs.BackendTimeout(
                f"TransferQueue {what} did not answer within {self.timeout_s:g}s: a storage "
                "unit, the controller or the Mooncake master is probably gone") from None

    def _get_meta(self, partition: str, keys: list[str]):
        return self._call(self._client.async_kv_retrieve_meta(
            keys=keys, partition_id=self._pid(partition), create=False), "kv_retrieve_meta")

    # -- the surface -------------------------------------------------------------------------
    def put(self, partition: str, keys: Sequence[str], columns: dict,
            tags: Sequence[dict] | None = None) -> None:
        import torch
        from tensordict import TensorDict

        check_name("partition", partition)
        keys = check_names("key", keys)
        check_tags(tags, len(keys))
        for name, col in columns.items():
            check_name("field", name)
            if not isinstance(col, torch.Tensor):
                raise TypeError(f"column {name!r} is a {type(col).__name__}; columns are "
                                "tensors (TransferQueue stores a TensorDict)")
            if col.is_nested and col.layout is not torch.jagged:
                raise TypeError(f"column {name!r} is a strided nested tensor; use "
                                "layout=torch.jagged")
            if col.dim() == 0:
                raise ValueError(f"column {name!r} is 0-d; a column needs one row per key")
            if col.size(0) != len(keys):
                raise ValueError(f"column {name!r} has {col.size(0)} rows for {len(keys)} keys")
        if not keys:  # the contract: a put of no keys stores nothing (TQ refuses an empty list)
            return
        layout = {LAYOUT_TAG + name: _layout_record(col) for name, col in columns.items()}
        per_key = [{**(dict(tags[i]) if tags is not None else {}), **layout}
                   for i in range(len(keys))]
        fields = (TensorDict({n: c.detach() for n, c in columns.items()}, batch_size=[len(keys)])
                  if columns else None)
        self._written.add(partition)
        self._call(self._tq.async_kv_batch_put(keys=keys, partition_id=self._pid(partition),
                                               fields=fields, tags=per_key), "kv_batch_put")

    def get(self, partition: str, keys: Sequence[str], select_fields: Sequence[str] | None = None
            ) -> tuple[dict, list[dict]]:
        keys, fields = check_get(partition, keys, select_fields)
        try:
            data = self._call(self._tq.async_kv_batch_get(
                keys=keys, partition_id=self._pid(partition), select_fields=fields),
                "kv_batch_get")
        except ValueError as exc:
            msg = str(exc)
            if _NOT_FOUND in msg:
                raise KeyError(f"keys {keys[:8]} or partition {partition!r} not found "
                               f"(TransferQueue: {msg})") from None
            if _NOT_READY in msg:
                raise KeyError(f"fields {fields} not stored for every key of {keys[:8]} in "
                               f"partition {partition!r} (TransferQueue: {msg})") from None
            raise
        meta = self._get_meta(partition, keys)
        stored = meta.get_all_custom_meta() if meta.size else []
        columns = {}
        for name in data.keys():
            records = [t.get(LAYOUT_TAG + name) for t in stored]
            columns[name] = _restore(data[name], records)
        tags = [{k: v for k, v in t.items() if not _is_layout_record(k)} for t in stored]
        return columns, tags

    def list(self, partition: str) -> list[str]:
        check_name("partition", partition)
        info = self._call(self._tq.async_kv_list(partition_id=self._pid(partition)), "kv_list")
        return list(info.get(self._pid(partition), []))  # a partition holding no keys: []

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None:
        check_name("partition", partition)
        if keys is not None:
            keys = check_names("key", keys)
            if not keys:  # the contract: clear of no keys removes nothing (TQ refuses [])
                return
        if keys is None:
            self._call(self._client.async_clear_partition(self._pid(partition)),
                       "clear_partition")
            self._written.discard(partition)
        else:
            self._call(self._tq.async_kv_clear(keys=list(keys), partition_id=self._pid(partition)),
                       "kv_clear")

    def close(self) -> None:
        """Drop what this instance wrote under its own namespace; the store stays up."""
        if self._closed:
            return
        if self._owns_namespace:
            self.timeout_s = min(self.timeout_s, 5.0)  # a dead store must not stall teardown
            for partition in list(self._written):
                if self._wedged:
                    break
                with contextlib.suppress(Exception):  # best effort: the store may be half gone
                    self.clear(partition)
        self._closed = True


def _join(address: dict) -> str:
    """Attach this process to the driver's Ray cluster and running TransferQueue (once).

    `tq.init()` with a controller already running only creates this process's client. Never
    call `tq.close()` from a joining process: it kills the shared controller actor (TQ 0.1.11
    `interface.close`); the client goes with the process.
    """
    import ray

    if not ray.is_initialized():
        ray.init(address=address["ray"], log_to_driver=False, configure_logging=False)
    tq = _tq()
    try:
        tq.get_client()
    except AssertionError:
        tq.init()
    return address["namespace"]


# -- sessions -----------------------------------------------------------------------------------
def _mb(var: str, default: int) -> int:
    return int(os.environ.get(var, str(default)))


def _loop_idle(client, timeout_s: float) -> bool:
    """Whether the TransferQueue client's event loop runs a no-op within `timeout_s`. A call
    the transport gave up on (`BackendTimeout`) may still hold that loop: TQ 0.1.11's
    MooncakeStorageClient.get waits for its batch_get_into worker threads inside the loop
    (`as_completed` in storage/clients/mooncake_client.py), and they retry a dead master."""
    loop = getattr(client, "_loop", None)  # the client's private loop (TQ 0.1.11)
    if loop is None or not loop.is_running():
        return True

    async def _noop() -> None:
        return None

    fut = asyncio.run_coroutine_threadsafe(_noop(), loop)
    try:
        fut.result(timeout=timeout_s)
        return True
    except concurrent.futures.TimeoutError:
        fut.cancel()
        return False


IDLE_BEFORE_CLOSE_S = 30.0


@contextlib.contextmanager
def _tq_running(conf: dict) -> Iterator[None]:
    tq = _tq()
    tq.init(conf)
    client = tq.get_client()
    store = getattr(client.storage_manager, "storage_client", None)
    try:
        yield
    finally:
        # Close nothing under a call still in flight: closing the Mooncake store client while
        # an abandoned get's worker thread is inside batch_get_into segfaulted this process
        # (3 of 11 runs of the store-kill test, mooncake-transfer-engine-non-cuda). If the loop
        # stays busy, the store client is left to process exit.
        idle = _loop_idle(client, IDLE_BEFORE_CLOSE_S)
        if not idle:
            warnings.warn(f"TransferQueue's client loop was still busy {IDLE_BEFORE_CLOSE_S:g}s "
                          "after the session ended: its store client is not closed", stacklevel=2)
        tq.close()
        if store is not None and idle:
            # tq.close() never closes the Mooncake store client: its segment stays mounted and
            # its threads keep reconnecting to the (stopped) master until garbage collection.
            with contextlib.suppress(Exception):
                store.close()


@contextlib.contextmanager
def simple_session() -> Iterator[None]:
    """Ray (2 CPUs) + TransferQueue with one SimpleStorage unit, stopped on exit.

    One storage unit because TransferQueue's init hangs when Ray has fewer CPUs than
    controller + units (BACKGROUND.md s6), and this machine class has 2 cores.
    """
    conf = {"backend": {"storage_backend": "SimpleStorage",
                        "SimpleStorage": {"num_data_storage_units": 1}}}
    with _procs.ray_cluster(num_cpus=2, object_store_mb=_mb("RLCONFORM_RAY_OBJECT_STORE_MB", 256)):
        with _tq_running(conf):
            yield


# The running Mooncake master, for tests that kill it (by PID) to check failure behaviour.
MOONCAKE_MASTER: _procs.Server | None = None


def start_mooncake_master(log_dir: Path | None = None) -> tuple[_procs.Server, int, int]:
    """Start a mooncake_master on free loopback ports; returns (server, rpc_port, http_port).

    The ELF binary is run directly (the console script execs it anyway), so the PID we hold
    is the server's. Flags mirror TransferQueue's own bootstrap (no eviction, long leases).
    """
    import mooncake

    binary = Path(mooncake.__file__).parent / "mooncake_master"
    rpc, http, metrics = _procs.free_port(), _procs.free_port(), _procs.free_port()
    cmd = [str(binary), "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
           "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
           f"--http_metadata_server_port={http}", f"--metrics_port={metrics}",
           "-client_ttl=30", "-default_kv_lease_ttl=999999", "-default_kv_soft_pin_ttl=999999",
           "--allow_evict_soft_pinned_objects=false", "--eviction_high_watermark_ratio=1.0",
           "--eviction_ratio=0.0"]
    log_dir = log_dir or Path(tempfile.gettempdir())
    log = log_dir / f"rlconform-mooncake-master-{os.getpid()}-{rpc}.log"
    return _procs.Server.start("mooncake_master", cmd, log, ports=(rpc, http)), rpc, http


@contextlib.contextmanager
def mooncake_session() -> Iterator[None]:
    """A mooncake_master (by PID) + Ray + TransferQueue on MooncakeStore over loopback TCP.

    `auto_init: false` because TransferQueue's own bootstrap first runs
    `pkill -f mooncake_master` (killing every master on the machine). Segment and buffer are
    small (RLCONFORM_MOONCAKE_SEGMENT_MB, default 256; RLCONFORM_MOONCAKE_BUFFER_MB, 64)
    because the defaults reserve 4 GiB + 1 GiB per client.
    """
    global MOONCAKE_MASTER
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        raise ImportError("the transferqueue-mooncake backend needs `pip install "
                          "mooncake-transfer-engine-non-cuda` and libibverbs1") from exc
    with _procs.env_vars(MC_TCP_BIND_ADDRESS="127.0.0.1"):
        master, rpc, http = start_mooncake_master()
        MOONCAKE_MASTER = master
        clean = False
        try:
            conf = {"backend": {"storage_backend": "MooncakeStore", "MooncakeStore": {
                "auto_init": False, "metadata_server": f"127.0.0.1:{http}",
                "master_server_address": f"127.0.0.1:{rpc}", "local_hostname": "127.0.0.1",
                "protocol": "tcp", "device_name": "",
                "global_segment_size": _mb("RLCONFORM_MOONCAKE_SEGMENT_MB", 256) << 20,
                "local_buffer_size": _mb("RLCONFORM_MOONCAKE_BUFFER_MB", 64) << 20}}}
            with _procs.ray_cluster(num_cpus=2,
                                    object_store_mb=_mb("RLCONFORM_RAY_OBJECT_STORE_MB", 256)):
                with _tq_running(conf):
                    yield
            clean = True
        finally:
            MOONCAKE_MASTER = None
            master.stop()
            if clean:  # keep the master's log only when the session failed
                master.log_path.unlink(missing_ok=True)


# why the surfaces beyond transport are not declared (reports list them with this reason)
STORE_NOTES = {s: "a key/value store: the codec, meta, batch ops, trainer and rollout around it "
                  "are the training framework's (verl and NeMo-RL drive TransferQueue; their "
                  "backends judge those)" for s in ("codec", "meta", "batch_ops", "trainer",
                                                       "rollout")}

# What the adapter changes between TransferQueue's answers and the contract, on every clause
# that reads the store back (the report states it per clause)
_RESTACK = (
    "TransferQueue hands a dense column of two or more dims back as a jagged nested tensor: "
    "put records each field's layout in the key's tags (under LAYOUT_TAG) and get restacks a "
    "column only when every row's record says dense with the shape each row has (_restore); "
    "any other column is returned as the library gave it")
_NOT_THERE = (
    "TransferQueue's ValueError for keys, a partition or fields it does not hold ('keys or "
    "partition were not found', 'fields are not ready') is raised as KeyError naming what "
    "was asked (the contract's error); a shorter or empty result is passed through")
NORMALISATIONS = {c.id: f"{_RESTACK}; {_NOT_THERE}" for c in CLAUSES if "transport" in c.surfaces}

STORE_NOTES["object_columns"] = (
    "not mapped: this adapter stores tensor columns; TransferQueue's per-row object leaves "
    "(NonTensorStack, as verl's rollout write puts multi_modal_inputs) are exercised by the verl "
    "backend")

simple_backend = Backend(
    name="transferqueue-simple",
    description="TransferQueue 0.1.11 KV API on SimpleStorage (one storage unit), Ray in process",
    transport=TransferQueueTransport,
    capabilities=frozenset(CAPABILITIES | {"multiprocess"}),
    session=simple_session,
    notes=dict(STORE_NOTES),
    normalisations=NORMALISATIONS,
    version=package_version("TransferQueue"),
)

mooncake_backend = Backend(
    name="transferqueue-mooncake",
    description="TransferQueue 0.1.11 KV API on MooncakeStore over loopback TCP (CPU), "
    "mooncake_master started by the session",
    transport=TransferQueueTransport,
    capabilities=frozenset(CAPABILITIES),
    session=mooncake_session,
    notes={**STORE_NOTES, "multiprocess": "a rank's client would mount its own Mooncake segment "
           "beside the driver's: not set up or tested here (docs/backends.md, rank processes)"},
    normalisations=NORMALISATIONS,
    version=", ".join(v for v in (package_version("TransferQueue"), package_version(
        "mooncake-transfer-engine-non-cuda", "Mooncake")) if v),
)
