"""Capture a model's op graph: ``torch.export`` first, ``torch.fx.symbolic_trace`` as the fallback.

``torch.export.export(module, args, strict=False)`` is used *without* ``run_decompositions`` so the
node names are the exported graph's own names: the runtime re-captures with this function and maps a
plan back to graph nodes by those names. Parameters and buffers are graph placeholders (export) or
``get_attr`` nodes (fx); they are not ops here, but every op records the parameter names it reads.
Model inputs are ops with ``op == "input"``. The module path of an op is the innermost entry of the
node's ``nn_module_stack`` (export) or the called submodule / the owner of the parameter (fx).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import fx, nn

from planner.errors import CaptureError, UsageError
from planner.formats.profile import INPUT_OP

log = logging.getLogger(__name__)

TRACERS = ("auto", "export", "fx")


@dataclass(frozen=True)
class CapturedOp:
    """One op of the captured graph, in topological order."""

    name: str
    """The graph's own node name."""
    op: str
    """``aten.linear.default`` style target name (export), a qualified callable (fx), or ``input``."""
    inputs: tuple[str, ...]
    """Names of the producer ops read by this op (parameters excluded)."""
    module_path: str
    """Innermost module path, e.g. ``blocks.3.attn.qkv`` ("" for the root module)."""
    params: tuple[str, ...]
    """Fully qualified names of the parameters and buffers this op reads (every use, not only the first)."""
    node: fx.Node


@dataclass(frozen=True)
class Captured:
    """A captured graph and how to feed it."""

    graph_module: fx.GraphModule
    tracer: str
    """``export`` or ``fx``: the tracer that produced the graph."""
    ops: tuple[CapturedOp, ...]
    program: Any = None
    """The ``torch.export.ExportedProgram`` when ``tracer == "export"``."""
    placeholder_params: Mapping[str, str] | None = None
    """Export only: placeholder name -> parameter/buffer/constant FQN (user inputs absent)."""

    def graph_args(self, module: nn.Module, inputs: Sequence[Any]) -> list[Any]:
        """Positional arguments for ``graph_module``: live parameters/buffers of ``module`` plus the user inputs."""
        if self.tracer == "fx":
            return list(inputs)
        tensors = _named_tensors(module)
        user = iter(torch.utils._pytree.tree_leaves(tuple(inputs)))
        args: list[Any] = []
        for spec in self.program.graph_signature.input_specs:
            kind = spec.kind.name
            if kind == "USER_INPUT":
                args.append(next(user))
            elif kind in ("PARAMETER", "BUFFER") and spec.target in tensors:
                args.append(tensors[spec.target])
            elif kind == "CONSTANT_TENSOR" or spec.target in self.program.constants:
                args.append(self.program.constants[spec.target])
            else:
                args.append(self.program.state_dict[spec.target])
        return args

    def call_target(self, node: fx.Node) -> Callable[..., Any]:
        """A callable that runs ``node`` alone on its (materialised) args and kwargs."""
        if node.op == "call_module":
            return self.graph_module.get_submodule(str(node.target))
        if node.op == "call_method":
            method = str(node.target)
            return lambda obj, *a, **kw: getattr(obj, method)(*a, **kw)
        return node.target  # call_function


def capture(module: nn.Module, example_inputs: Sequence[Any], tracer: str = "auto") -> Captured:
    """Capture ``module`` on ``example_inputs`` with ``tracer`` ("auto" tries export, then fx)."""
    if tracer not in TRACERS:
        raise UsageError(f"--tracer must be one of {', '.join(TRACERS)}, found {tracer!r}; pick one of those")
    inputs = tuple(example_inputs)
    with quiet_torch():
        if tracer == "export":
            return _capture_export(module, inputs)
        if tracer == "fx":
            return _capture_fx(module, inputs)
        try:
            return _capture_export(module, inputs)
        except CaptureError as export_error:
            log.info("torch.export failed, trying torch.fx: %s", export_error)
            try:
                return _capture_fx(module, inputs)
            except CaptureError as fx_error:
                reasons = (str(e).rsplit("; try --tracer", 1)[0] for e in (export_error, fx_error))
                raise CaptureError("neither tracer could capture the model: " + "; and ".join(reasons) +
                                   "; make that code traceable (no Python branching on tensor values: "
                                   "use torch.where or torch.cond)") from None


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """Hold back torch's log records, warnings and stderr prints while tracing (a failed export dumps graphs);
    the failure itself becomes one ``CaptureError``. With ``plan -v`` (INFO logging) nothing is held back."""
    if log.isEnabledFor(logging.INFO):
        yield
        return
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.split(".")[0] == "torch"]
    loggers.append(logging.getLogger("torch"))
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    held = io.StringIO()  # torch.export prints a failed trace's partial graph straight to sys.stderr
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(held):
            warnings.simplefilter("ignore")
            yield
    finally:
        if held.getvalue():
            log.debug("held back from stderr while tracing:\n%s", held.getvalue())
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _capture_export(module: nn.Module, inputs: tuple[Any, ...]) -> Captured:
    try:
        program = torch.export.export(module, inputs, strict=False)
    except Exception as exc:  # export raises many types (UserError, Unsupported, RuntimeError, ...)
        raise CaptureError(f"torch.export failed {_where(exc)}: {_first_line(exc)}; try --tracer fx") from None
    names = {s.arg.name: s.target for s in program.graph_signature.input_specs
             if s.kind.name != "USER_INPUT" and getattr(s.arg, "name", None) and s.target is not None}
    ops = []
    for node in program.graph_module.graph.nodes:
        if node.op in ("output", "get_attr") or node.name in names:
            continue
        params = tuple(dict.fromkeys(names[n.name] for n in node.all_input_nodes if n.name in names))
        inputs_ = tuple(n.name for n in node.all_input_nodes if n.name not in names and n.op != "get_attr")
        op = INPUT_OP if node.op == "placeholder" else _target_name(node)
        ops.append(CapturedOp(node.name, op, inputs_, _stack_path(node), params, node))
    return Captured(program.graph_module, "export", tuple(ops), program, names)


def _capture_fx(module: nn.Module, inputs: tuple[Any, ...]) -> Captured:
    try:
        graph_module = fx.symbolic_trace(module)
    except Exception as exc:
        raise CaptureError(f"torch.fx.symbolic_trace failed {_where(exc)}: {_first_line(exc)}; try --tracer export") from None
    _record_values(graph_module, inputs)
    attrs = {n.name: str(n.target) for n in graph_module.graph.nodes if n.op == "get_attr"}
    ops = []
    for node in graph_module.graph.nodes:
        if node.op in ("output", "get_attr"):
            continue
        params = [attrs[n.name] for n in node.all_input_nodes if n.name in attrs]
        path = ""
        if node.op == "call_module":
            path = str(node.target)
            sub = graph_module.get_submodule(path)
            params = [f"{path}.{k}" for k, _ in sub.named_parameters()] + [f"{path}.{k}" for k, _ in sub.named_buffers()] + params
        elif params:
            path = params[0].rpartition(".")[0]
        inputs_ = tuple(n.name for n in node.all_input_nodes if n.name not in attrs)
        op = INPUT_OP if node.op == "placeholder" else _target_name(node, graph_module)
        ops.append(CapturedOp(node.name, op, inputs_, path, tuple(dict.fromkeys(params)), node))
    return Captured(graph_module, "fx", tuple(ops))


def _target_name(node: fx.Node, graph_module: fx.GraphModule | None = None) -> str:
    """``aten.linear.default`` for OpOverloads, ``module:torch.nn.Linear`` / ``Tensor.view`` / qualified names for fx."""
    target = node.target
    if node.op == "call_module" and graph_module is not None:
        cls = type(graph_module.get_submodule(str(target)))
        return f"module:{cls.__module__}.{cls.__qualname__}"
    if node.op == "call_method":
        return f"Tensor.{target}"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    module = {"_operator": "operator", "builtins": "builtins"}.get(module, module)
    return f"{module}.{name}" if module else name


def _stack_path(node: fx.Node) -> str:
    """Innermost module path from ``nn_module_stack``, normalised to dotted form (``blocks.3.attn``)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = dict(module.named_buffers(remove_duplicate=False))
    tensors.update(module.named_parameters(remove_duplicate=False))
    return tensors


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    line = f"{type(exc).__name__}: {line}"
    return line if len(line) <= 300 else line[:297] + "..."


def _where(exc: BaseException) -> str:
    """``at file.py:LINE (code)`` for the innermost traceback frame outside torch and the stdlib, if any."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename and "/site-packages/" not in f.filename
              and "/planner/profile/" not in f.filename and "/lib/python" not in f.filename]
    if not frames:
        return ""
    frame = frames[-1]
    code = f" `{frame.line.strip()}`" if frame.line else ""
    return f"at {frame.filename}:{frame.lineno}{code}"


def _record_values(graph_module: fx.GraphModule, inputs: tuple[Any, ...]) -> None:
    """Give an fx graph what torch.export's has: ``meta["val"]`` on every node, from one run on the example
    inputs (tensors as ``meta``-device tensors of the same shape and dtype; sizes and ints as they are). The
    runtime reads it to keep tuples and shape arithmetic (``x.size(1)``) from crossing a stage boundary."""

    class Recorder(fx.Interpreter):
        def run_node(self, node: fx.Node) -> Any:
            value = super().run_node(node)
            node.meta["val"] = torch.utils._pytree.tree_map(
                lambda v: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v, value)
            return value

    devices = sorted({x.device.index for x in inputs if isinstance(x, torch.Tensor) and x.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            Recorder(graph_module).run(*inputs)
    except Exception as exc:  # the profile's own measurement reports a model that does not run
        log.info("could not record the fx graph's values: %s", exc)

