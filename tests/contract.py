"""What the specforge backend relies on in SpecForge's and SGLang's pinned releases, checked in their source.

Read with `ast`, never imported (SGLang cannot be imported without its GPU kernels). Three kinds
of check, each a list of problems (empty: the contract holds):

- `check_imports`: every `from specforge...`/`from sglang...` name a module imports (our backend,
  and SpecForge's capture package, which we run) exists in the module it names (following
  `import *` and lazy `__all__` + `__getattr__` exports);
- `check_expectations`: the functions, methods, parameters, dataclass fields and source lines
  listed in `CONTRACT` (the calls our backend makes, the SGLang calls SpecForge's capture makes,
  and the rules our data depends on, like SGLang's +1 on capture ids);
- `server_args_collisions`: the ServerArgs our backend adds are fields, and not ones SpecForge's
  `build` already passes (a duplicate keyword is a TypeError after torchrun has started).
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Sources:
    """Unpacked release trees (each holding its top-level package), with optional per-file replacements."""
    roots: list[Path]
    overrides: dict[str, str] = field(default_factory=dict)  # "sglang/srt/x.py" -> text
    _cache: dict[str, ast.Module | None] = field(default_factory=dict)

    def module_path(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            if rel in self.overrides or any((root / rel).is_file() for root in self.roots):
                return rel
        return None

    def tree(self, rel: str) -> ast.Module | None:
        if rel not in self._cache:
            text = self.overrides.get(rel)
            if text is None:
                for root in self.roots:
                    if (root / rel).is_file():
                        text = (root / rel).read_text(encoding="utf-8")
                        break
            self._cache[rel] = ast.parse(text) if text is not None else None
        return self._cache[rel]


def _package_of(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1])  # for pkg/__init__.py the package itself; for pkg/mod.py, pkg


def _absolute(rel: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = _package_of(rel).split(".")
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def defines(src: Sources, module: str, name: str, _seen: set[str] | None = None) -> bool:
    """Whether `from module import name` would find `name` (or `module.name` is a submodule)."""
    seen = _seen if _seen is not None else set()
    if module in seen:
        return False
    seen.add(module)
    if src.module_path(f"{module}.{name}") is not None:
        return True
    rel = src.module_path(module)
    tree = src.tree(rel) if rel else None
    if tree is None:
        return False
    lazy = False
    for node in tree.body:
        if _binds(node, name):
            return True
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            lazy = True
        if isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names) \
                and defines(src, _absolute(rel, node), name, seen):
            return True
    return lazy and name in _all_names(tree)


def _binds(node: ast.stmt, name: str) -> bool:
    """Whether a module's top-level statement binds `name`: a def or class, an assignment, an import
    (an optional one inside try included)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names)
    if isinstance(node, ast.Try):  # optional imports
        return any(isinstance(sub, (ast.Import, ast.ImportFrom))
                   and any((a.asname or a.name.split(".")[0]) == name for a in sub.names) for sub in ast.walk(node))
    return False


def _all_names(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:
                return set()
    return set()


def imports_of(tree: ast.Module, rel: str, prefixes: tuple[str, ...]) -> list[tuple[str, str, int]]:
    """(module, name, line) of every `from X import name` anywhere in `tree` with X under `prefixes`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(rel, node)
            if module.split(".")[0] in prefixes:
                out += [(module, a.name, node.lineno) for a in node.names if a.name != "*"]
    return out


def check_imports(src: Sources, files: dict[str, ast.Module], prefixes: tuple[str, ...]) -> list[str]:
    problems = []
    for rel, tree in files.items():
        for module, name, line in imports_of(tree, rel, prefixes):
            if src.module_path(module) is None:
                problems.append(f"{rel}:{line}: module {module} does not exist in the pinned release")
            elif not defines(src, module, name):
                problems.append(f"{rel}:{line}: {module} has no {name}")
    return problems


@dataclass(frozen=True)
class Expect:
    """One thing a pinned release must have: a function or method (with these parameters), a class's
    fields, or lines in a function's source (compared after ast.unparse, so formatting does not matter)."""
    module: str
    qualname: str                   # "func", "Class", "Class.method"
    params: tuple[str, ...] = ()    # must be named parameters
    kwonly: tuple[str, ...] = ()    # must be keyword-only parameters
    fields: tuple[str, ...] = ()    # annotated class attributes (dataclass fields, ServerArgs) or enum members
    source: tuple[str, ...] = ()    # fragments of ast.unparse(the def)
    why: str = ""


def _find(tree: ast.Module, qualname: str) -> ast.AST | None:
    scope: list[ast.stmt] = tree.body
    found: ast.AST | None = None
    for part in qualname.split("."):
        found = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and n.name == part), None)
        if found is None:
            return None
        scope = found.body  # type: ignore[attr-defined]
    return found


def _class_fields(node: ast.ClassDef) -> set[str]:
    names = set()
    for n in node.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, ast.Assign):
            names.update(t.id for t in n.targets if isinstance(t, ast.Name))
    return names


def _method_in_bases(src: Sources, module: str, cls: ast.ClassDef, method: str, depth: int = 0) -> bool:
    """A method inherited from a base class defined in the same module (DeepseekV3 from DeepseekV2)."""
    if depth > 5:
        return False
    rel = src.module_path(module)
    tree = src.tree(rel) if rel else None
    for base in cls.bases:
        if isinstance(base, ast.Name) and tree is not None:
            parent = _find(tree, base.id)
            if isinstance(parent, ast.ClassDef):
                if _find(tree, f"{base.id}.{method}") is not None or _method_in_bases(src, module, parent, method,
                                                                                      depth + 1):
                    return True
    return False


def check_expectations(src: Sources, expectations: list[Expect]) -> list[str]:
    problems = []
    for e in expectations:
        where = f"{e.module}.{e.qualname}" + (f" ({e.why})" if e.why else "")
        rel = src.module_path(e.module)
        tree = src.tree(rel) if rel else None
        if tree is None:
            problems.append(f"{where}: module {e.module} not in the pinned release")
            continue
        node = _find(tree, e.qualname)
        if node is None and "." in e.qualname:
            cls_name, method = e.qualname.rsplit(".", 1)
            cls = _find(tree, cls_name)
            if isinstance(cls, ast.ClassDef) and _method_in_bases(src, e.module, cls, method) and not (
                    e.params or e.kwonly or e.source):
                continue
        if node is None:
            problems.append(f"{where}: not found")
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            named = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
            kwonly = {x.arg for x in a.kwonlyargs}
            problems += [f"{where}: no parameter {p!r}" for p in e.params if p not in named]
            problems += [f"{where}: {p!r} is not keyword-only" for p in e.kwonly if p not in kwonly]
        elif e.params or e.kwonly:
            problems.append(f"{where}: is not a function")
        if e.fields:
            if not isinstance(node, ast.ClassDef):
                problems.append(f"{where}: is not a class")
            else:
                have = _class_fields(node)
                problems += [f"{where}: no field {f!r}" for f in e.fields if f not in have]
        if e.source:
            text = _squeeze(ast.unparse(node))
            problems += [f"{where}: its source no longer has `{frag}`" for frag in e.source
                         if _squeeze(frag) not in text and _squeeze(_normal(frag)) not in text]
    return problems


def _squeeze(text: str) -> str:
    return "".join(text.split())


def _normal(fragment: str) -> str:
    try:
        return ast.unparse(ast.parse(fragment))
    except SyntaxError:  # a piece of an expression ("'a': 'b'", "**kwargs"): compared as written
        return fragment


def call_keywords(src: Sources, module: str, qualname: str, callee: str) -> tuple[set[str], bool]:
    """Keyword names passed to `callee(...)` inside a function, and whether it forwards **kwargs."""
    rel = src.module_path(module)
    tree = src.tree(rel) if rel else None
    node = _find(tree, qualname) if tree else None
    names: set[str] = set()
    forwards = False
    if node is None:
        return names, forwards
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == callee:
            for kw in sub.keywords:
                if kw.arg is None:
                    forwards = True
                else:
                    names.add(kw.arg)
    return names, forwards


def server_args_collisions(src: Sources, ours: set[str]) -> list[str]:
    problems = []
    fields = set()
    rel = src.module_path("sglang.srt.server_args")
    tree = src.tree(rel) if rel else None
    cls = _find(tree, "ServerArgs") if tree else None
    if isinstance(cls, ast.ClassDef):
        fields = _class_fields(cls)
    else:
        return ["sglang.srt.server_args.ServerArgs: not found"]
    problems += [f"ServerArgs has no field {k!r} (the specforge backend passes it)" for k in sorted(ours - fields)]
    passed, forwards = call_keywords(src, "specforge.offline_capture.sglang_backend.capture",
                                     "OfflineSGLangCaptureBackend.build", "ServerArgs")
    if not forwards:
        problems.append("OfflineSGLangCaptureBackend.build no longer forwards **kwargs to ServerArgs")
    problems += [f"ServerArgs {k!r}: SpecForge's build already passes it (duplicate keyword)"
                 for k in sorted(ours & passed)]
    problems += [f"ServerArgs has no field {k!r} (SpecForge's build passes it)" for k in sorted(passed - fields)]
    return problems


def signature_from_ast(node: ast.FunctionDef | ast.AsyncFunctionDef, *, method: bool = False) -> inspect.Signature:
    """The def's signature as inspect would give it (defaults stand in as None); `method` drops self."""
    a = node.args
    params: list[inspect.Parameter] = []
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    for i, x in enumerate(positional):
        kind = inspect.Parameter.POSITIONAL_ONLY if i < len(a.posonlyargs) else inspect.Parameter.POSITIONAL_OR_KEYWORD
        params.append(inspect.Parameter(x.arg, kind, default=None if i >= first_default else inspect.Parameter.empty))
    if a.vararg:
        params.append(inspect.Parameter(a.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        params.append(inspect.Parameter(x.arg, inspect.Parameter.KEYWORD_ONLY,
                                        default=inspect.Parameter.empty if d is None else None))
    if a.kwarg:
        params.append(inspect.Parameter(a.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    if method:
        params = params[1:]
    return inspect.Signature(params)


@dataclass(frozen=True)
class CallSite:
    callee: str            # the name called in the backend (a function, or the method's attribute name)
    line: int
    positional: int
    keywords: tuple[str, ...]
    splat: bool            # passes **something


def call_sites(tree: ast.Module, names: set[str]) -> list[CallSite]:
    """Every call in `tree` of a function or method named in `names` (`f(...)`, `x.y.f(...)`)."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name in names:
            out.append(CallSite(name, node.lineno, len(node.args), tuple(k.arg for k in node.keywords if k.arg),
                                any(k.arg is None for k in node.keywords)))
    return out


def check_call_sites(src: Sources, tree: ast.Module, sites: dict[str, tuple[str, str]],
                     splat_keys: set[str]) -> list[str]:
    """Bind each of the backend's calls to the pinned release's signature of what it calls.

    `sites` maps the called name to (module, qualname) in the release; a `**` argument is bound as
    `splat_keys` (the ServerArgs our backend passes). A renamed, dropped or newly required
    parameter is a TypeError from inspect's bind, reported with the line of our call.
    """
    problems = []
    found = call_sites(tree, set(sites))
    for name in sorted(set(sites) - {c.callee for c in found}):
        problems.append(f"the backend no longer calls {name}: update CALL_SITES in tests/contract.py")
    for call in found:
        module, qualname = sites[call.callee]
        rel = src.module_path(module)
        mod = src.tree(rel) if rel else None
        node = _find(mod, qualname) if mod is not None else None
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            problems.append(f"specforge_backend.py:{call.line}: {call.callee}(...) calls {module}.{qualname}, "
                            f"which the pinned release does not define")
            continue
        sig = signature_from_ast(node, method="." in qualname)
        kwargs = dict.fromkeys(call.keywords, None)
        if call.splat:
            kwargs.update(dict.fromkeys(splat_keys - set(kwargs), None))
        try:
            sig.bind(*([None] * call.positional), **kwargs)
        except TypeError as e:
            problems.append(f"specforge_backend.py:{call.line}: {call.callee}(...) does not bind to "
                            f"{module}.{qualname}{sig}: {e}")
    return problems


SF_CAPTURE = "specforge.offline_capture.sglang"
SF_BACKEND = "specforge.offline_capture.sglang_backend.capture"

CONTRACT: list[Expect] = [
    # What draftgen's specforge backend calls.
    Expect("specforge.distributed", "init_distributed", params=("timeout", "tp_size")),
    Expect("specforge.distributed", "destroy_distributed"),
    Expect(SF_CAPTURE, "load_offline_eagle3_capture", params=("pretrained_model_name_or_path",),
           kwonly=("torch_dtype", "trust_remote_code"), source=("**kwargs",)),
    Expect(SF_CAPTURE, "OfflineSGLangCapture.set_capture_layers", params=("layer_ids",), kwonly=("capture_method",)),
    Expect(SF_CAPTURE, "OfflineSGLangCapture.capture", kwonly=("input_ids", "attention_mask", "loss_mask"),
           source=("torch.cat([hidden.unsqueeze(0) for hidden in aux_states], dim=0)",
                   "torch.cat([hidden.unsqueeze(0) for hidden in last_states], dim=0)"),
           why="rows are stacked on a new batch dim: every row must have one width, so we right-pad"),
    Expect(SF_CAPTURE, "OfflineCaptureBatch", fields=("hidden_states", "last_hidden_states")),
    Expect(SF_BACKEND, "OfflineSGLangCaptureBackend.set_capture_layers",
           source=("'eagle3': 'set_eagle3_layers_to_capture'",)),
    Expect(SF_BACKEND, "OfflineSGLangCaptureBackend.capture_eagle3",
           source=("origin_input_ids=input_row.view(-1).tolist()",),
           why="each whole row is one request: padding goes in, so we cut each sample back to its length"),
    Expect(SF_BACKEND, "OfflineSGLangCaptureBackend.build", source=("chunked_prefill_size=-1",),
           why="a sample is one forward: docs/gpu-extraction.md's memory advice depends on it"),
    # SGLang's capture-id rules our layer convention depends on (model_info.sglang_capture_ids).
    Expect("sglang.srt.models.llama", "LlamaForCausalLM.set_eagle3_layers_to_capture",
           source=("self.model.layers_to_capture = [val + 1 for val in layer_ids]",)),
    Expect("sglang.srt.models.llama", "LlamaModel.forward",
           source=("if i in self.layers_to_capture:\n    aux_hidden_states.append(hidden_states + residual)",),
           why="an id names the input of that layer: the output of the one before"),
    Expect("sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture",
           source=("if layer_ids and layer_ids[0] == 1:\n"
                   "    self.model.layers_to_capture = [val + 1 for val in layer_ids]\n"
                   "else:\n    self.model.layers_to_capture = list(layer_ids)",)),
    Expect("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM.set_eagle3_layers_to_capture"),
    Expect("sglang.srt.models.kimi_k25", "KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture",
           source=("self.language_model.set_eagle3_layers_to_capture(layer_ids)",)),
    # Serving: SGLang hands the draft config's eagle_aux_hidden_state_layer_ids to the same setter
    # (stats.json's draft_layer_ids are those ids).
    Expect("sglang.srt.model_executor.model_runner", "ModelRunner.__init__",
           source=("self.eagle_aux_hidden_state_layer_ids = eagle_config['eagle_aux_hidden_state_layer_ids']",)),
    Expect("sglang.srt.model_executor.model_runner", "ModelRunner.init_aux_hidden_state_capture",
           source=("self.model.set_eagle3_layers_to_capture(self.eagle_aux_hidden_state_layer_ids)",)),
    # SGLang calls SpecForge's capture makes (beyond the imports, which check_imports covers).
    Expect("sglang.srt.model_executor.model_runner", "ModelRunner.__init__",
           params=("model_config", "mem_fraction_static", "gpu_id", "tp_rank", "tp_size", "moe_ep_rank",
                   "moe_ep_size", "pp_rank", "pp_size", "server_args", "nccl_port", "is_draft_worker")),
    Expect("sglang.srt.model_executor.model_runner", "ModelRunner.alloc_memory_pool"),
    Expect("sglang.srt.model_executor.model_runner", "ModelRunner.init_attention_backends"),
    Expect("sglang.srt.model_executor.model_runner", "ModelRunner.init_cuda_graphs"),
    Expect("sglang.srt.model_executor.model_runner", "ModelRunner.forward", params=("forward_batch",)),
    Expect("sglang.srt.configs.model_config", "ModelConfig.from_server_args", params=("server_args",)),
    Expect("sglang.srt.managers.schedule_batch", "Req.__init__",
           params=("rid", "origin_input_text", "origin_input_ids", "sampling_params")),
    Expect("sglang.srt.managers.schedule_batch", "ScheduleBatch.init_new",
           params=("reqs", "req_to_token_pool", "token_to_kv_pool_allocator", "tree_cache", "model_config",
                   "enable_overlap", "spec_algorithm")),
    Expect("sglang.srt.managers.schedule_batch", "ScheduleBatch.prepare_for_extend"),
    Expect("sglang.srt.managers.schedule_batch", "ScheduleBatch", fields=("prefill_input_ids_cpu", "input_ids")),
    Expect("sglang.srt.model_executor.forward_batch_info", "ForwardBatch.init_new", params=("batch", "model_runner")),
    Expect("sglang.srt.model_executor.forward_batch_info", "CaptureHiddenMode", fields=("FULL",)),
    Expect("sglang.srt.model_executor.forward_batch_info", "ForwardMode", fields=("DECODE",)),
    Expect("sglang.srt.sampling.sampling_params", "SamplingParams.__init__",
           params=("temperature", "max_new_tokens", "top_k")),
    Expect("sglang.srt.mem_cache.cache_init_params", "CacheInitParams",
           fields=("disable", "req_to_token_pool", "token_to_kv_pool_allocator", "page_size")),
    Expect("sglang.srt.speculative.spec_info", "SpeculativeAlgorithm", fields=("NONE",)),
    Expect("sglang.srt.layers.logits_processor", "LogitsProcessor._get_pruned_states"),
    Expect("sglang.srt.layers.logits_processor", "LogitsProcessor._get_hidden_states_to_store"),
    Expect("sglang.srt.layers.logits_processor", "LogitsMetadata.from_forward_batch"),
]

# Every call the specforge backend makes into SpecForge: the name it calls -> what that is in the release.
CALL_SITES = {
    "init_distributed": ("specforge.distributed", "init_distributed"),
    "destroy_distributed": ("specforge.distributed", "destroy_distributed"),
    "load_offline_eagle3_capture": (SF_CAPTURE, "load_offline_eagle3_capture"),
    "set_capture_layers": (SF_CAPTURE, "OfflineSGLangCapture.set_capture_layers"),
    "capture": (SF_CAPTURE, "OfflineSGLangCapture.capture"),
}

# What our backend touches on SpecForge's objects (tests check the backend's source uses no others).
CAPTURE_METHODS = {"set_capture_layers", "capture"}
BATCH_FIELDS = {"hidden_states", "last_hidden_states"}
