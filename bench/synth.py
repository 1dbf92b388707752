"""Synthesise a deep model's profile from one measured layer: a GPT-3-like graph of 96 layers.

GPT-3 175B has 96 identical decoder layers between its embeddings and its head. We cannot measure
it here, so we take a measured profile of a smaller GPT of the same shape (``planner.examples.gpt``),
keep its embeddings and head, and repeat its second layer's nodes (measured costs, bytes, FLOPs and the
roofline estimates they carry) ``num_layers`` times, wiring each copy to the one before exactly as
layer 1 is wired to layer 0. Depth and the layer-to-head cost ratio are GPT-3-like; the width is the
measured model's. Pure function: profile in, profile out.

    python3 bench/synth.py bench/.cache/gpt_medium.json 96 -o bench/.cache/gpt3_96.json
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace
from types import MappingProxyType

from planner.errors import PlannerError
from planner.formats.profile import Node, Profile, load_profile, save_profile
from planner.partition.model.problem import layer_of

_INDEXED = re.compile(r"^(.*)\.(\d+)$")


def split_layers(profile: Profile) -> tuple[list[Node], list[list[Node]], list[Node]]:
    """(nodes before the first repeated layer, each repeated layer's nodes in order, nodes after the last)."""
    prefix: list[Node] = []
    layers: dict[str, list[Node]] = {}
    suffix: list[Node] = []
    for node in profile.nodes:
        label = layer_of(node.module_path)
        if _INDEXED.match(label):
            if suffix:
                raise PlannerError(f"layer {label!r} follows non-layer nodes; cannot synthesise from this graph")
            layers.setdefault(label, []).append(node)
        elif layers:
            suffix.append(node)
        else:
            prefix.append(node)
    return prefix, list(layers.values()), suffix


def synthesize(profile: Profile, num_layers: int) -> Profile:
    """``profile`` with its repeated layers replaced by ``num_layers`` copies of its layer 1."""
    prefix, layers, suffix = split_layers(profile)
    if len(layers) < 2 or num_layers < 1:
        raise PlannerError("need a profile with at least two repeated layers and num_layers >= 1")
    first, template = layers[0], layers[1]
    if [n.op for n in first] != [n.op for n in template]:
        raise PlannerError("layers 0 and 1 differ in their ops; cannot repeat one")
    to_first = {t.name: f.name for t, f in zip(template, first)}  # layer-1 node -> its layer-0 twin
    nodes = list(prefix) + list(first)
    previous = {f.name: f.name for f in first}  # layer-0 node name -> same node in the previous copy
    for k in range(1, num_layers):
        current = {}
        for t, f in zip(template, first):
            name = f"{f.name}__L{k}"
            inputs = tuple(current.get(to_first.get(src, ""), None) or _outside(src, to_first, previous)
                           for src in t.inputs)
            nodes.append(replace(t, name=name, inputs=inputs, module_path=_relabel(t.module_path, k),
                                 params=tuple(f"L{k}.{p}" for p in t.params)))
            current[f.name] = name
        previous = current
    last = layers[-1]
    to_last_copy = {n.name: previous[f.name] for n, f in zip(last, first)}
    for node in suffix:
        nodes.append(replace(node, inputs=tuple(to_last_copy.get(src, src) for src in node.inputs)))
    model = dict(profile.model, name=f"{profile.model.get('name', 'model')}-{num_layers}L",
                 synthesized_from=profile.model.get("source", ""), layers=num_layers)
    return Profile(model=MappingProxyType(model), nodes=tuple(nodes), extra=profile.extra)


def _outside(src: str, to_first: dict[str, str], previous: dict[str, str]) -> str:
    """An input from outside the template layer: layer 0's output becomes the previous copy's."""
    if src in to_first:
        raise AssertionError("inside inputs are resolved by the caller")
    return previous.get(src, src)


def _relabel(path: str, k: int) -> str:
    """``blocks.1.attn`` -> ``blocks.{k}.attn`` (the first indexed component)."""
    label = layer_of(path)
    match = _INDEXED.match(label)
    return path.replace(label, f"{match.group(1)}.{k}", 1) if match else path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("layers", type=int)
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args()
    save_profile(synthesize(load_profile(args.profile), args.layers), args.output)


if __name__ == "__main__":
    main()
