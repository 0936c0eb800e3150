"""Draw docs/architecture.png from docs/architecture.dot with matplotlib (no Graphviz needed).

    pip install -e ".[plot]"
    python scripts/draw_architecture.py            # writes docs/architecture.png
    python scripts/draw_architecture.py --check    # exit 1 when the picture is behind its source

The .dot file stays the one source: Graphviz reads it as usual (`dot -Tpng`), and this script
reads the same nodes, clusters and edges, placing each node at its `xy="x,y"` attribute (pixels of
a 1456 x 880 canvas, y down; Graphviz ignores attributes it does not know) and bending an edge by
its `rad` (matplotlib's arc3 curvature). The picture records the SHA-256 of the source it was
drawn from in a PNG text chunk (`Source-SHA256`), which tests/test_docs.py compares with the .dot,
so a picture left behind its source fails the suite.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import tempfile
import zlib
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOT = os.path.join(REPO, "docs", "architecture.dot")
PNG = os.path.join(REPO, "docs", "architecture.png")
WIDTH, HEIGHT, DPI = 1456, 880, 96
HASH_KEY = "Source-SHA256"

_ATTRS = re.compile(r'(\w+)\s*=\s*("(?:[^"\\]|\\.)*"|[^,\];\s]+)')
_NODE = re.compile(r"^\s*(\w+)\s*\[(.*)\]\s*;?\s*$")
_EDGE = re.compile(r"^\s*(\w+)\s*->\s*(\w+)\s*(?:\[(.*)\])?\s*;?\s*$")
_CLUSTER = re.compile(r"^\s*subgraph\s+(cluster_\w+)\s*\{")
_DEFAULTS = ("node", "edge", "graph")


@dataclass
class Node:
    name: str
    attrs: dict[str, str]
    cluster: str | None


@dataclass
class Cluster:
    name: str
    attrs: dict[str, str] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)


@dataclass
class Graph:
    nodes: dict[str, Node]
    edges: list[tuple[str, str, dict[str, str]]]
    clusters: dict[str, Cluster]


def _attrs(text: str) -> dict[str, str]:
    out = {}
    for key, value in _ATTRS.findall(text or ""):
        if value.startswith('"'):
            value = value[1:-1].replace('\\"', '"')
        out[key] = value
    return out


def source_hash(path: str = DOT) -> str:
    """The SHA-256 of the .dot source, as the picture records it."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def parse_dot(path: str = DOT) -> Graph:
    """Nodes, edges and clusters of our .dot subset (one statement per line)."""
    nodes: dict[str, Node] = {}
    edges: list[tuple[str, str, dict[str, str]]] = []
    clusters: dict[str, Cluster] = {}
    current: Cluster | None = None
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.split("//")[0].rstrip() if raw.lstrip().startswith("//") else raw.rstrip()
            if not line.strip():
                continue
            if m := _CLUSTER.match(line):
                current = clusters.setdefault(m.group(1), Cluster(m.group(1)))
            elif line.strip() == "}":
                current = None
            elif m := _EDGE.match(line):
                edges.append((m.group(1), m.group(2), _attrs(m.group(3))))
            elif (m := _NODE.match(line)) and m.group(1) not in _DEFAULTS:
                cluster = current.name if current else None
                nodes[m.group(1)] = Node(m.group(1), _attrs(m.group(2)), cluster)
                if current:
                    current.nodes.append(m.group(1))
            elif current and "label=" in line and "[" not in line:
                current.attrs.update(_attrs(line))
    for name, node in nodes.items():
        if "xy" not in node.attrs:
            raise ValueError(f"{path}: node {name!r} has no xy attribute (where to draw it)")
    for tail, head, _ in edges:
        for end in (tail, head):
            if end not in nodes:
                raise ValueError(f"{path}: an edge names {end!r}, which is not a node")
    return Graph(nodes, edges, clusters)


def _xy(node: Node) -> tuple[float, float]:
    x, y = (float(v) for v in node.attrs["xy"].split(","))
    return x, y


def _label(text: str) -> str:
    return text.replace("\\n", "\n")


def draw(graph: Graph, out: str, digest: str) -> None:
    """Render the graph to `out` (PNG), recording `digest` as the source's hash."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, WIDTH)
    ax.set_ylim(HEIGHT, 0)
    ax.axis("off")
    boxes = {}
    for node in graph.nodes.values():
        oval = node.attrs.get("shape") == "oval"
        style = "round,pad=0.9,rounding_size=1.6" if oval else "round,pad=0.5,rounding_size=0.7"
        text = ax.text(
            *_xy(node),
            _label(node.attrs.get("label", node.name)),
            ha="center",
            va="center",
            fontsize=9.5,
            family="DejaVu Sans",
            zorder=3,
            bbox=dict(boxstyle=style, fc=node.attrs.get("fillcolor", "#ffffff"), ec="#222222", lw=1.0),
        )
        boxes[node.name] = text
    fig.canvas.draw()
    _draw_clusters(ax, fig, graph, boxes)
    for tail, head, attrs in graph.edges:
        _draw_edge(ax, boxes, graph, tail, head, attrs)
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=os.path.dirname(out))
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=DPI, metadata={HASH_KEY: digest})
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        plt.close(fig)


def _draw_clusters(ax, fig, graph: Graph, boxes) -> None:
    from matplotlib.patches import FancyBboxPatch

    renderer = fig.canvas.get_renderer()
    inverse = ax.transData.inverted()
    for cluster in graph.clusters.values():
        corners = []
        for name in cluster.nodes:
            extent = boxes[name].get_bbox_patch().get_window_extent(renderer)
            corners += [inverse.transform((extent.x0, extent.y0)), inverse.transform((extent.x1, extent.y1))]
        xs = [c[0] for c in corners]
        ys = [c[1] for c in corners]
        x0, x1, y0, y1 = min(xs) - 22, max(xs) + 22, min(ys) - 34, max(ys) + 16
        color = cluster.attrs.get("color", "#999999")
        dashed = "dashed" in cluster.attrs.get("style", "")
        title = ax.text(
            (x0 + x1) / 2,
            y0 + 12,
            cluster.attrs.get("label", ""),
            ha="center",
            va="center",
            fontsize=11.5,
            color=cluster.attrs.get("fontcolor", color),
            family="DejaVu Sans",
        )
        extent = title.get_window_extent(renderer)
        left, right = (inverse.transform((x, extent.y0))[0] for x in (extent.x0, extent.x1))
        x0, x1 = min(x0, left - 12), max(x1, right + 12)  # the title fits inside its box
        ax.add_patch(
            FancyBboxPatch(
                (x0, y0),
                x1 - x0,
                y1 - y0,
                boxstyle="round,pad=0,rounding_size=12",
                fc="none",
                ec=color,
                lw=1.0,
                ls="--" if dashed else "-",
                zorder=1,
            )
        )


def _draw_edge(ax, boxes, graph: Graph, tail: str, head: str, attrs: dict[str, str]) -> None:
    rad = float(attrs.get("rad", "0"))
    color = attrs.get("color", "#555555")
    (x1, y1), (x2, y2) = _xy(graph.nodes[tail]), _xy(graph.nodes[head])
    ax.annotate(
        "",
        xy=(x2, y2),
        xytext=(x1, y1),
        zorder=2,
        arrowprops=dict(
            arrowstyle="-|>,head_length=0.7,head_width=0.3",
            color=color,
            lw=1.0,
            ls="--" if attrs.get("style") == "dashed" else "-",
            patchA=boxes[tail].get_bbox_patch(),
            patchB=boxes[head].get_bbox_patch(),
            shrinkA=1,
            shrinkB=2,
            connectionstyle=f"arc3,rad={rad}",
        ),
    )
    if "label" in attrs:
        # the midpoint of arc3's quadratic curve: half way to its control point (display y is up,
        # this axis' y is down, so the perpendicular's sign flips)
        mx = (x1 + x2) / 2 - 0.5 * rad * (y2 - y1)
        my = (y1 + y2) / 2 + 0.5 * rad * (x2 - x1)
        dx, dy = (float(v) for v in attrs.get("labelxy", "0,0").split(","))
        ax.text(
            mx + dx,
            my + dy,
            _label(attrs["label"]),
            ha="center",
            va="center",
            fontsize=8.5,
            color=attrs.get("fontcolor", "#222222"),
            family="DejaVu Sans",
            zorder=4,
            bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.85),
        )


def recorded_hash(path: str = PNG) -> str | None:
    """The source hash a picture drawn by this script records (None if it records none)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG file")
    at = 8
    while at + 8 <= len(data):
        length = int.from_bytes(data[at : at + 4], "big")
        kind = data[at + 4 : at + 8]
        body = data[at + 8 : at + 8 + length]
        if kind in (b"tEXt", b"zTXt", b"iTXt"):
            key, _, value = body.partition(b"\0")
            if key.decode("latin-1") == HASH_KEY:
                if kind == b"zTXt":
                    value = zlib.decompress(value[1:])
                elif kind == b"iTXt":
                    value = value[2:].split(b"\0", 2)[-1]
                return value.decode("utf-8")
        at += 12 + length
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="only check that the picture was drawn from the current source"
    )
    args = parser.parse_args(argv)
    digest = source_hash()
    if args.check:
        ok = recorded_hash() == digest
        print(
            "docs/architecture.png is "
            + ("current" if ok else "behind docs/architecture.dot: run python scripts/draw_architecture.py")
        )
        return 0 if ok else 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit('draw_architecture.py needs matplotlib: pip install -e ".[plot]"')
    draw(parse_dot(), PNG, digest)
    print(f"wrote {os.path.relpath(PNG, REPO)} from docs/architecture.dot ({digest[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
