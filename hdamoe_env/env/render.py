"""RGB rendering of a layer's per-link utilisation as a heat map (``render_mode="rgb_array"``).

numpy only (no matplotlib): the image is built from index arithmetic on the topology's link
table, so rendering inside a vector env or a video recorder costs microseconds.

Two layouts:

* **mesh** — the chip as seen from above. Node (row, col) is a grey square; each directed link
  between neighbours is a bar between the two squares, coloured by its utilisation: the link
  towards higher column (row) index on the upper (left) half of the gap, the reverse link on
  the other half, so both directions of a full-duplex link stay visible.
* **torus / fat-tree** — a vertex × vertex matrix: cell (u, v) is the utilisation of the link
  u → v; cells without a link are dark grey. (A wrap-around or switch link has no natural
  place in a grid drawing.)

The colour map is a piecewise-linear ramp from dark blue (idle) through red to yellow
(saturated); utilisation is clipped to [0, 1].
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.noc.topology import Topology

__all__ = ["NO_LINK_RGB", "NODE_RGB", "heat_colors", "link_heatmap_rgb"]

#: Colour of a node square (mesh layout).
NODE_RGB = (150, 150, 150)
#: Colour of a matrix cell without a link (matrix layout) and of the background.
NO_LINK_RGB = (40, 40, 40)

# anchors of the colour ramp: utilisation -> RGB
_RAMP_AT = np.array([0.0, 0.35, 0.7, 1.0])
_RAMP_RGB = np.array([[20, 30, 110], [140, 40, 140], [230, 60, 40], [255, 230, 50]],
                     dtype=np.float64)


def heat_colors(values: ArrayLike) -> NDArray[np.uint8]:
    """Map utilisations to RGB colours of the heat ramp.

    Args:
        values: [n] utilisations; clipped to [0, 1], NaN counts as 0.

    Returns:
        uint8 [n, 3] colours; 0 is dark blue, 1 is yellow.
    """
    v = np.nan_to_num(np.asarray(values, dtype=np.float64).ravel(), nan=0.0)
    v = np.clip(v, 0.0, 1.0)
    rgb = np.stack([np.interp(v, _RAMP_AT, _RAMP_RGB[:, c]) for c in range(3)], axis=1)
    out: NDArray[np.uint8] = np.rint(rgb).astype(np.uint8)
    return out


def link_heatmap_rgb(topology: Topology, link_util: ArrayLike,
                     cell_px: int = 16) -> NDArray[np.uint8]:
    """Draw the per-link utilisation of a topology as an RGB image.

    Args:
        topology: The NoC (``kind`` "mesh" uses the chip layout, the others the matrix layout).
        link_util: [num_links] utilisation of every directed link (busy time ÷ layer latency).
        cell_px: Pixels per grid cell (mesh: per node square and per link gap; matrix: per
            vertex).

    Returns:
        uint8 [H, W, 3] image. Mesh X×Y: H = (2X − 1)·cell_px, W = (2Y − 1)·cell_px. Matrix:
        H = W = V·cell_px for V vertices.

    Raises:
        ConfigError: ``link_util`` does not have one value per link, or ``cell_px`` < 2.
    """
    util = np.asarray(link_util, dtype=np.float64).ravel()
    if util.shape != (topology.num_links,):
        raise ConfigError(f"link_util must have one value per link ({topology.num_links}), got "
                          f"shape {np.shape(link_util)}")
    if int(cell_px) < 2:
        raise ConfigError(f"cell_px must be >= 2, got {cell_px}")
    cell = int(cell_px)
    colors = heat_colors(util)
    if topology.kind == "mesh":
        return _mesh_image(topology, colors, cell)
    return _matrix_image(topology, colors, cell)


def _mesh_image(topology: Topology, colors: NDArray[np.uint8], cell: int) -> NDArray[np.uint8]:
    """Chip layout: nodes on even grid cells, the two directions of a link in the gap."""
    X, Y = topology.grid_shape
    img = np.empty(((2 * X - 1) * cell, (2 * Y - 1) * cell, 3), dtype=np.uint8)
    img[:] = NO_LINK_RGB
    coords = topology.endpoint_coords
    for node in range(topology.num_endpoints):
        r, c = 2 * int(coords[node, 0]), 2 * int(coords[node, 1])
        img[r * cell:(r + 1) * cell, c * cell:(c + 1) * cell] = NODE_RGB
    half = cell // 2
    src = topology.link_src.tolist()
    dst = topology.link_dst.tolist()
    for link, (u, v) in enumerate(zip(src, dst, strict=True)):
        (ru, cu), (rv, cv) = coords[u].tolist(), coords[v].tolist()
        gr, gc = ru + rv, cu + cv            # the gap cell between the two nodes (doubled coords)
        y0, x0 = gr * cell, gc * cell
        if ru == rv:                         # horizontal link: upper half = towards higher col
            rows = slice(y0, y0 + half) if cv > cu else slice(y0 + half, y0 + cell)
            img[rows, x0:x0 + cell] = colors[link]
        else:                                # vertical link: left half = towards higher row
            cols = slice(x0, x0 + half) if rv > ru else slice(x0 + half, x0 + cell)
            img[y0:y0 + cell, cols] = colors[link]
    return img


def _matrix_image(topology: Topology, colors: NDArray[np.uint8],
                  cell: int) -> NDArray[np.uint8]:
    """Vertex × vertex matrix: cell (u, v) coloured by the link u → v."""
    V = topology.num_vertices
    grid = np.empty((V, V, 3), dtype=np.uint8)
    grid[:] = NO_LINK_RGB
    grid[topology.link_src, topology.link_dst] = colors
    img: NDArray[np.uint8] = np.repeat(np.repeat(grid, cell, axis=0), cell, axis=1)
    return img
