"""Hugging Face checkpoint folders <-> posttrain models, without torch.

`from_pretrained(path)` reads config.json (as transformers' AutoConfig would, which also upgrades
old rope formats), translates it into a ModelConfig, builds the model abstractly
(`nnx.eval_shape`), and fills it tensor by tensor from single or sharded safetensors (placed
with their logical sharding when a mesh is given). `save_pretrained(model, path)` writes
config.json + safetensors (split into shards with an index past `max_shard_bytes`) that
`transformers.AutoModelForCausalLM.from_pretrained` loads.

Writing a folder never loses the user's files: the export is written into a sibling temporary
folder `OUT.tmp-XXXX` and renamed into place (an existing OUT is renamed aside first and deleted
only once the new one is in place), so a failure (a full disk) leaves the previous OUT as it was
and no temporary folder behind. An existing OUT is replaced only when it is empty or a previous
export (its `.posttrain-export.json` lists every file in it), unless `overwrite=True`; a run
folder (config.yaml beside checkpoints/, metrics.jsonl or trainable.safetensors) is never replaced.

Sequence classifiers (reward models): a model with a score head (`models/heads.py`) is saved as
`<Family>ForSequenceClassification` (backbone `model.*`, `score.weight` [num_labels, D], no
`lm_head`, `id2label` giving num_labels), which `AutoModelForSequenceClassification` loads;
`from_pretrained(path, head="score")` reads such a folder (ours or transformers') back.

Gemma 4 (`models/families/gemma4.py` holds its fields and extra names): `gemma4_text` folders load like any
other; a multimodal `gemma4` folder loads its text model only when asked (`text_only=True`), since
its vision and audio towers are not supported; it then exports as a `gemma4_text` folder.
A vision-language folder (`qwen3_vl`, `gemma3`: its family's `VisionFamily`, `models/family.py`) loads whole and
exports back as one: Qwen3-VL as a Transformer with its tower (`ModelConfig.vision`), Gemma 3 as `vision/gemma3.py`'s
Gemma3VL (the `build` of `models/families/gemma3_vl.py`); with `text_only=True`, its text model alone.

What it is not: a downloader. Paths are local folders; nothing is fetched from a hub.
The tensor names of each family are `models/hf_names.py`'s weight_map.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from posttrain.errors import PosttrainError
from posttrain.models.config import ModelConfig
from posttrain.models.families import family_named, family_of_multimodal
from posttrain.models.family import vision_of

# config_from_hf and config_to_hf are re-exported: `from posttrain.models.hf import config_from_hf` keeps working
from posttrain.models.hf_config import (  # noqa: F401
    classifier_class,
    config_from_hf,
    config_to_hf,
    read_hf_config,
    supported,
)
from posttrain.models.hf_names import fused_names, weight_map
from posttrain.models.layers import Buffer
from posttrain.models.transformer import Transformer

HEADS = (None, "score")
EXPORT_MARKER = ".posttrain-export.json"  # written into every export: the files it wrote
DTYPES = {"float32": ("float32", "fp32", "float", "f32"), "bfloat16": ("bfloat16", "bf16"),
          "float16": ("float16", "fp16", "half", "f16")}
_DTYPE_ALIASES = {alias: name for name, aliases in DTYPES.items() for alias in aliases}


def canonical_dtype(name: Optional[str], where: str = "dtype") -> Optional[str]:
    """'float32' | 'bfloat16' | 'float16' for any of their usual aliases (fp16, half, bf16, fp32, float, ...);
    None stays None; anything else is a PosttrainError listing what is accepted."""
    if name is None:
        return None
    if not isinstance(name, str):  # a numpy / jax dtype object
        try:
            name = np.dtype(jnp.dtype(name)).name
        except TypeError:
            pass
    key = str(name).strip().lower()
    if key not in _DTYPE_ALIASES:
        accepted = "; ".join(f"{n} ({', '.join(a[1:])})" for n, a in DTYPES.items())
        raise PosttrainError(f"{where} {name!r} is not a supported weights dtype; use one of {accepted}")
    return _DTYPE_ALIASES[key]


# ----------------------------------------------------------------------------- safetensors


def _check_safetensors(path: str) -> None:
    """Fail clearly on a missing or truncated file (header says more bytes than are there)."""
    if not os.path.isfile(path):
        raise PosttrainError(f"{path}: safetensors file is missing; copy the complete checkpoint folder again")
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("header length beyond end of file")
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError) as e:
        raise PosttrainError(f"{path}: not a readable safetensors file ({e}); the file is corrupt or "
                             "truncated, copy it again") from None
    if 8 + n + end > size:
        raise PosttrainError(f"{path}: truncated safetensors file ({size} bytes, header needs {8 + n + end}); "
                             "copy the file again")


def tensor_files(path: str) -> dict[str, str]:
    """HF key -> safetensors file, from the index json or the single model.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                shard_of = json.load(fh)["weight_map"]
        except (ValueError, KeyError) as e:
            raise PosttrainError(f"{index}: unreadable index ({e}); it needs a 'weight_map' object") from None
        if not isinstance(shard_of, dict):
            raise PosttrainError(f"{index}: 'weight_map' must be an object of tensor name -> shard file")
        root = os.path.abspath(path)
        for k, f in shard_of.items():  # a shard path that leaves the folder would read any file on the machine
            inside = os.path.normpath(os.path.join(root, f)) if isinstance(f, str) else ""
            if not isinstance(f, str) or os.path.isabs(f) or os.path.commonpath([root, inside]) != root:
                raise PosttrainError(f"{index}: the shard of tensor {k!r} is {f!r}, which is not a file inside "
                                     f"the model folder {path}; shard paths must be relative names inside it, "
                                     "such as model-00001-of-00002.safetensors")
        return {k: os.path.join(path, f) for k, f in shard_of.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise PosttrainError(f"{path}: no model.safetensors or model.safetensors.index.json; posttrain reads "
                             "safetensors checkpoints only (convert .bin files with transformers first)")
    _check_safetensors(single)
    with safe_open(single, "numpy") as f:
        return {k: single for k in f.keys()}


# ----------------------------------------------------------------------------- public API


def load_config(path: str, text_only: bool = False) -> ModelConfig:
    """ModelConfig of a HF folder (config.json only); text_only: the text model of a multimodal `gemma4` folder.
    A vision-language folder (`gemma3`) gives its text model's config either way."""
    return _read_config(path, text_only)[0]


def load_vision_config(path: str, text_only: bool = False):
    """The vision config of a vision-language HF folder as `from_pretrained` loads it (Qwen3-VL's VisionConfig,
    Gemma 3's Gemma3VisionConfig), or None (a text model, or text_only)."""
    return _read_config(path, text_only)[3]


def _read_config(path: str, text_only: bool) -> tuple:
    """(ModelConfig, prefix of the backbone's weight names, the multimodal folder's family or None, its vision config
    when the folder loads as a vision-language model, else None; a tower inside the Transformer is also cfg.vision)."""
    if not os.path.isdir(path):
        raise PosttrainError(f"{path}: model folder does not exist; pass a local Hugging Face checkpoint folder")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise PosttrainError(f"{cfg_file}: missing; a Hugging Face model folder needs config.json "
                             "(save the model with save_pretrained)")
    try:
        with open(cfg_file) as fh:
            raw = json.load(fh)
    except ValueError as e:
        raise PosttrainError(f"{cfg_file}: invalid JSON ({e})") from None
    mt = raw.get("model_type")
    multimodal = family_of_multimodal(mt)
    if multimodal and not text_only and multimodal.vision is None:
        raise multimodal.multimodal_error(cfg_file, raw)
    if mt not in supported() and not multimodal:
        raise PosttrainError(
            f"{cfg_file}: model_type {mt!r} (architectures {raw.get('architectures')}) is not "
            f"supported; posttrain loads {', '.join(supported())}")
    # config.json read as transformers' config classes read it, without importing transformers (and torch)
    hf, tied = read_hf_config(raw, cfg_file)
    if not multimodal:
        return config_from_hf(hf, cfg_file), "model.", None, None
    # The outer config ties the text model's lm_head (or not), as Gemma4ForConditionalGeneration. The vision part
    # (Family.vision): a tower inside the Transformer (no `build`: Qwen3-VL) is ModelConfig.vision; else the
    # family's `build` makes the model around the Transformer in from_pretrained (Gemma 3)
    cfg = config_from_hf(hf, f"{cfg_file} text_config").replace(tie_embeddings=tied)
    vision = multimodal.vision.read(raw, cfg_file) if multimodal.vision and not text_only else None
    if vision is not None and multimodal.vision.build is None:
        cfg = cfg.replace(vision=vision)
    return cfg, multimodal.text_prefix, multimodal, vision


def from_pretrained(path: str, dtype: str = "float32", mesh=None, compute_dtype: Optional[str] = None,
                    rules: Optional[dict] = None, head: Optional[str] = None, text_only: bool = False):
    """Load a HF checkpoint folder into a Transformer (parameters in `dtype`).

    text_only: load the text model of a multimodal `gemma4` folder (its vision and audio towers are
    not supported; without this flag such a folder is an error saying so). A vision-language `gemma3` folder
    and a `qwen3_vl` folder load whole (Gemma3VL with its text model at `.text`; a Transformer with its tower)
    unless text_only.

    With a `mesh`, each tensor is placed directly with its logical sharding under `rules`
    (default: the fsdp_tp rules), so the model never lands whole on one device.
    `head="score"` loads a `*ForSequenceClassification` folder: the backbone plus its `score`
    head (`models/heads.py`), no LM head."""
    if head not in HEADS:
        raise PosttrainError(f"from_pretrained: head={head!r}; use one of {HEADS}")
    dtype = canonical_dtype(dtype)
    compute_dtype = canonical_dtype(compute_dtype, "compute_dtype")
    cfg, prefix, fam, vision = _read_config(path, text_only)
    cfg = cfg.replace(param_dtype=dtype, dtype=compute_dtype or dtype)
    if vision is not None and head is not None:
        raise PosttrainError(f"{path}: a vision-language folder has no {head} head; pass text_only=True")

    def build():
        if vision is not None and fam.vision.build is not None:
            return fam.vision.build(cfg, vision, nnx.Rngs(0))
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        if head == "score":
            from posttrain.models.heads import attach_score_head

            attach_score_head(model, num_labels=_num_labels(path))
        return model

    abstract = nnx.eval_shape(build)
    graphdef, state = nnx.split(abstract)
    shardings = None
    if mesh is not None:
        from posttrain.sharding import put, state_shardings
        shardings = dict(nnx.to_flat_state(state_shardings(state, mesh, rules)))
    files = tensor_files(path)
    checked: set = set()
    handles: dict = {}
    if fam is not None:  # a multimodal folder may keep its text model under another prefix
        prefix = next((p for p in (prefix, *fam.other_text_prefixes) if p + "embed_tokens.weight" in files), prefix)
    wmap = weight_map(cfg, head, prefix)
    if vision is not None:  # the tower's (and projector's) names around the text model's
        wmap = fam.vision.weight_names(wmap, vision, files)
    fused_map = fused_names(cfg, prefix)  # Qwen3-Next: names held inside one fused tensor on disk
    fused = {part: (key, j) for key, (parts, _, _) in fused_map.items() for j, part in enumerate(parts)}
    flat = dict(nnx.to_flat_state(state))

    parts: dict = {}  # a fused tensor's split parts not yet read (each fused tensor is read and split once)

    def read(name):
        if name in fused and name not in files:
            key, j = fused[name]
            if key not in parts:
                whole = read(key)
                try:
                    parts[key] = dict(enumerate(fused_map[key][1](whole)))
                except ValueError:
                    raise PosttrainError(f"{path}: tensor {key!r} {whole.shape} does not split into the linear "
                                         "heads config.json gives; restore the checkpoint's own config.json") from None
            part = parts[key].pop(j)
            if not parts[key]:
                del parts[key]
            return part
        if name not in files:
            hint = "the folder does not match its config.json (wrong or partial checkpoint)"
            if name == "score.weight":
                hint = ("it is not a sequence classifier (reward model); attach a new head with "
                        "models.heads.attach_score_head instead")
            elif "score.weight" in files:
                hint = ("it is a sequence classifier (reward model): load it with head='score', or "
                        "with posttrain.rewards.RewardModel")
            raise PosttrainError(f"{path}: tensor {name!r} is missing from the checkpoint; {hint}")
        fname = files[name]
        if fname not in checked:
            _check_safetensors(fname)
            checked.add(fname)
            handles[fname] = safe_open(fname, "numpy")
        return handles[fname].get_tensor(name)

    try:
        for key, var in flat.items():
            if key not in wmap:
                raise AssertionError(f"no HF name for posttrain parameter {key}")
            names, load = wmap[key][:2]
            if names[0] not in files and len(wmap[key]) > 3 and wmap[key][3][0][0] in files:
                names, load = wmap[key][3]
            arrays = [read(name) for name in names]
            try:
                value = load(*arrays)
            except (ValueError, IndexError):  # a reshape or a channel permutation of a tensor of the wrong shape
                value = None
            if value is None or value.shape != var.shape:
                shapes = ", ".join(f"{n} {a.shape}" for n, a in zip(names, arrays))
                raise PosttrainError(
                    f"{path}: tensor shape mismatch for {shapes}; config.json implies {var.shape} for posttrain "
                    f"parameter {'.'.join(map(str, key))}. The weights do not belong to this config.json: "
                    "restore the checkpoint's own config.json or load matching weights")
            value = value.astype(np.dtype(jnp.dtype(dtype)))  # host array: placed once, sharded if a mesh
            value = jnp.asarray(value) if shardings is None else put(value, shardings[key])
            var.set_value(value) if hasattr(var, "set_value") else setattr(var, "value", value)
    finally:
        for h in handles.values():
            if hasattr(h, "__exit__"):
                h.__exit__(None, None, None)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def save_pretrained(model: Transformer, path: str, tokenizer=None, max_shard_bytes: int = 5 * 2**30,
                    dtype: Optional[str] = None, overwrite: bool = False, files=(), **config_extra) -> str:
    """Write config.json + safetensors (+ tokenizer, + `files` copied as they are: a vision-language folder's
    image processor file) that transformers loads; atomic per folder.

    An existing `path` is replaced only when it is empty or a previous export (else pass overwrite=True;
    a run folder is never replaced), see `check_export_target`; the new folder is written beside it
    and swapped in by renames. A full disk raises a PosttrainError and leaves `path` as it was.
    A model with a score head (`models/heads.py`) is written as `<Family>ForSequenceClassification`
    (pass a tokenizer, or pad_token_id=..., so transformers can find each row's last token)."""
    check_export_target(path, overwrite)
    dtype = canonical_dtype(dtype)
    cfg = model.cfg
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, Buffer))))
    out_dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    head = "score" if ("score",) in flat else None
    if head == "score":
        labels = range(flat[("score",)].shape[-1])
        cls = classifier_class(cfg.family)
        if cls is None:
            raise PosttrainError(f"cannot export a {cfg.family} model with a score head: transformers has no "
                                 f"{cfg.family} sequence classifier")
        config_extra = {"architectures": [cls], "id2label": {str(i): f"LABEL_{i}" for i in labels},
                        "label2id": {f"LABEL_{i}": i for i in labels}, **config_extra}
    tensors: dict[str, np.ndarray] = {}
    vision, vcfg = vision_of(model)  # a vision-language model: its family's VisionFamily and vision config
    wmap = weight_map(cfg, head) if vision is None else vision.weight_names(
        weight_map(cfg, head, family_named(cfg.family).text_prefix), vcfg, None)
    for key, (names, _, save, *_alt) in wmap.items():
        arr = np.asarray(jax.device_get(flat[key][...])).astype(out_dtype)
        for n, a in zip(names, save(arr)):
            tensors[n] = np.ascontiguousarray(a)
    for key, (parts, _, join) in fused_names(cfg).items():  # Qwen3-Next's fused tensors
        tensors[key] = np.ascontiguousarray(join(*(tensors.pop(p) for p in parts)))
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
        shards, cur, size = [], {}, 0
        for n, a in tensors.items():
            if cur and size + a.nbytes > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[n] = a
            size += a.nbytes
        shards.append(cur)
        if len(shards) == 1:
            save_file(shards[0], os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        else:
            shard_of = {}
            for i, s in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(s, os.path.join(tmp, fname), metadata={"format": "pt"})
                shard_of.update({n: fname for n in s})
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
                json.dump({"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
                           "weight_map": shard_of}, fh, indent=2)
        extra = dict(config_extra)
        if tokenizer is not None:
            extra.setdefault("bos_token_id", tokenizer.bos_id)
            extra.setdefault("eos_token_id", tokenizer.eos_id)
            extra.setdefault("pad_token_id", tokenizer.pad_id)
            tokenizer.save_pretrained(tmp)
        for f in files:
            shutil.copyfile(f, os.path.join(tmp, os.path.basename(f)))
        # a vision-language model: the text model's config inside the folder's, both in the written dtype
        hf_cfg = config_to_hf(cfg.replace(param_dtype=out_dtype.name), vcfg, **extra)
        hf_cfg["dtype"] = str(out_dtype)
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(hf_cfg, fh, indent=2)
        with open(os.path.join(tmp, EXPORT_MARKER), "w") as fh:  # what a later export may replace
            json.dump({"written_by": "posttrain export", "files": sorted(_files(tmp))}, fh, indent=1)
        install(tmp, path)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":  # a full disk, no permission, ...
            why = getattr(e, "strerror", None) or str(e).strip().splitlines()[0][:200]
            where = f" ({e.filename})" if getattr(e, "filename", None) and e.filename != tmp else ""
            kept = "is unchanged" if os.path.exists(path) else "was not created"
            raise PosttrainError(f"could not write the export to {path}: {why}{where}; {path} {kept} and no "
                                 "temporary folder is left; free disk space (or make the folder writable) and "
                                 "run the same command again") from e
        raise
    return path


def _num_labels(path: str) -> int:
    """num_labels of a classifier folder: the rows of its score.weight (the config may omit id2label)."""
    fname = tensor_files(path).get("score.weight")
    if fname is None:
        return 1  # from_pretrained reports the missing tensor
    with safe_open(fname, "numpy") as f:
        return int(f.get_slice("score.weight").get_shape()[0])


def _files(folder: str) -> list[str]:
    """Every file under `folder`, as paths relative to it."""
    return [os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs]


RUN_ENTRIES = ("checkpoints", "metrics.jsonl", "trainable.safetensors")  # beside config.yaml: a run folder
_RUN_OWN = RUN_ENTRIES + ("config.yaml", "tensorboard", "profile", "report", "wandb", ".lock")  # a run's own


def is_run_folder(folder: str) -> bool:
    """A folder written by a posttrain trainer: config.yaml beside checkpoints/, metrics.jsonl or its weights."""
    return os.path.isfile(os.path.join(folder, "config.yaml")) and any(
        os.path.exists(os.path.join(folder, name)) for name in RUN_ENTRIES)


def _export_listing(folder: str) -> Optional[set]:
    """The files a posttrain export wrote into `folder` (its marker's list), or None: not an export."""
    try:
        with open(os.path.join(folder, EXPORT_MARKER)) as fh:
            return set(json.load(fh)["files"]) | {EXPORT_MARKER}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_export_target(out: str, overwrite: bool = False, run_dir: Optional[str] = None) -> None:
    """Raise a PosttrainError unless an export may be written to (and replace) `out`.

    Never: a file; a run folder, or a folder inside one's own files (checkpoints/, ...) or holding
    one (`run_dir` or any run folder below `out`), whatever `overwrite` says. A folder of its own under
    a run folder, such as RUN/hf, is fine. An existing folder is replaced when it is empty or a previous
    export, else only with `overwrite` (it holds files export did not write)."""
    real = os.path.realpath(out)
    fix = "choose another --out (e.g. a new folder such as RUN/hf)"
    if run_dir is not None:
        run = os.path.realpath(run_dir)
        if real == run or os.path.commonpath([real, run]) == real:
            what = "is the run folder" if real == run else f"holds the run folder {run_dir}"
            raise PosttrainError(f"--out {out} {what}; exporting there would replace the run; {fix}")
    up = real
    while True:  # out itself, or under a run folder's own files (its checkpoints, its config, ...)
        if is_run_folder(up):
            rel = os.path.relpath(real, up)
            if rel == ".":
                raise PosttrainError(f"--out {out} is a run folder (config.yaml beside "
                                     f"{', '.join(n for n in RUN_ENTRIES if os.path.exists(os.path.join(up, n)))}); "
                                     f"exporting there would replace the run; {fix}")
            if rel.split(os.sep)[0] in _RUN_OWN:
                raise PosttrainError(f"--out {out} is inside the files of the run folder {up}; exporting there "
                                     f"would replace them; {fix}")
        if os.path.dirname(up) == up:
            break
        up = os.path.dirname(up)
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise PosttrainError(f"--out {out} is an existing file, not a folder; {fix}")
    for d, _, _ in os.walk(out):  # a run folder below: never replaced, --overwrite or not
        if d != out and is_run_folder(d):
            raise PosttrainError(f"--out {out} holds the run folder {d}; exporting there would delete it; {fix}")
    listed = _export_listing(out)
    foreign = sorted(set(_files(out)) - (listed or set()))
    if overwrite or not os.listdir(out) or (listed is not None and not foreign):
        return
    foreign = foreign or sorted(os.listdir(out))  # (only empty folders)
    raise PosttrainError(f"--out {out} already holds files that posttrain export did not write ({foreign[0]!r}"
                         + (f" and {len(foreign) - 1} more" if len(foreign) > 1 else "")
                         + f"); {fix}, or pass --overwrite to replace the whole folder")


def install(tmp: str, path: str) -> None:
    """Move a finished export into place. An existing folder is renamed aside first, the new one renamed
    into its place, and only then is the old one deleted (a failure in between puts the old one back)."""
    if not os.path.exists(path):
        os.rename(tmp, path)
        return
    parent, base = os.path.split(path)
    old = tempfile.mkdtemp(prefix=base + ".old-", dir=parent)
    os.rename(path, old)  # onto the empty folder mkdtemp made: replaces it (POSIX)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)
