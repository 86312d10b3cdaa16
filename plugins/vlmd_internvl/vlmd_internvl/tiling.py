"""InternVL's tiling: which grid of tiles an image is cut into, and what that costs.

An image is resized to ``columns x rows`` tiles of the tower's square size (448 px in the
published checkpoints) and cut into them; when there is more than one tile a thumbnail (the
whole image resized to one tile) follows. Every tile becomes ``tokens_per_tile`` placeholders
(256: 32x32 patches of 14 px, pixel-shuffled 0.5 into 16x16). The grid is the one whose
aspect ratio is closest to the image's among the grids of ``min_tiles..max_tiles`` tiles; on
a tie the later grid (more tiles) wins while the image's area is over half the grid's. This
is transformers' ``GotOcr2ImageProcessor`` (``crop_to_patches``), the processor of
``InternVLForConditionalGeneration``, with the same floating-point comparisons, so grids and
counts agree exactly.

The limits come from the checkpoint's image processor config (``min_patches``,
``max_patches``), may be replaced server-wide (--mm-processor-kwargs) and narrowed per
request (``mm_processor_kwargs``; vLLM's ``min_dynamic_patch``/``max_dynamic_patch`` are
accepted as the same settings). A request may not raise ``max_patches`` above the server's:
the encoder budget and cache were sized at start-up for the server's largest image.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from vlmd.errors import BadRequestError

# Each setting under transformers' name and the name vLLM's InternVL takes for it.
KWARG_NAMES = {"min_patches": "min_patches", "max_patches": "max_patches",
               "min_dynamic_patch": "min_patches", "max_dynamic_patch": "max_patches"}


@dataclass(frozen=True)
class TileGrid:
    """How one image is cut: ``columns x rows`` tiles, then a thumbnail when there are several."""

    columns: int
    rows: int
    thumbnail: bool

    @property
    def tiles(self) -> int:
        """Tiles through the tower, the thumbnail included."""
        return self.columns * self.rows + int(self.thumbnail)


@dataclass(frozen=True)
class TileSettings:
    tile_height: int
    tile_width: int
    min_patches: int
    max_patches: int
    tokens_per_tile: int
    resample: int = 3  # PIL bicubic

    def with_kwargs(self, kwargs: dict[str, Any]) -> "TileSettings":
        """These settings under processor kwargs (already merged: server-wide, then request)."""
        unknown = sorted(set(kwargs) - set(KWARG_NAMES))
        if unknown:
            raise BadRequestError(
                f"unknown mm_processor_kwargs {unknown}; InternVL takes {sorted(KWARG_NAMES)}",
                param="mm_processor_kwargs",
            )
        values: dict[str, int] = {}
        for name, value in kwargs.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadRequestError(f"mm_processor_kwargs.{name} must be a positive integer", param="mm_processor_kwargs")
            setting = KWARG_NAMES[name]
            if values.get(setting, value) != value:
                raise BadRequestError(f"mm_processor_kwargs gives {setting} twice with different values",
                                      param="mm_processor_kwargs")
            values[setting] = value
        settings = replace(self, **values)
        if settings.min_patches > settings.max_patches:
            raise BadRequestError(
                f"min_patches {settings.min_patches} is larger than max_patches {settings.max_patches}",
                param="mm_processor_kwargs",
            )
        return settings

    def grid(self, height: int, width: int) -> TileGrid:
        """The grid an image of this size is cut into."""
        if self.max_patches <= 1:
            return TileGrid(1, 1, False)  # one resized tile, as transformers without cropping
        columns, rows = optimal_grid(height, width, self.tile_height, self.tile_width, self.min_patches, self.max_patches)
        return TileGrid(columns, rows, thumbnail=columns * rows > 1)

    def most_tiles(self) -> int:
        """Tiles of the costliest image: the largest grid, with its thumbnail."""
        if self.max_patches <= 1:
            return 1
        return self.max_patches + 1


@lru_cache(maxsize=64)
def supported_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """(columns, rows) of every grid of ``min_tiles..max_tiles`` tiles, fewest tiles first
    (a stable sort of the columns-major enumeration, as transformers orders them)."""
    grids = [(columns, rows) for columns in range(1, max_tiles + 1) for rows in range(1, max_tiles + 1)
             if min_tiles <= columns * rows <= max_tiles]
    return tuple(sorted(grids, key=lambda grid: grid[0] * grid[1]))


def optimal_grid(height: int, width: int, tile_height: int, tile_width: int, min_tiles: int,
                 max_tiles: int) -> tuple[int, int]:
    """(columns, rows): the grid whose aspect ratio is closest to the image's."""
    aspect_ratio = width / height
    area = width * height
    best_difference = float("inf")
    best = (1, 1)
    for grid in supported_grids(min_tiles, max_tiles):
        difference = abs(aspect_ratio - grid[0] / grid[1])
        if difference < best_difference:
            best_difference, best = difference, grid
        elif difference == best_difference and area > 0.5 * tile_height * tile_width * grid[0] * grid[1]:
            best = grid  # a tie: more tiles, while they do not magnify the image past twice its area
    return best


def tile_boxes(grid: TileGrid, tile_height: int, tile_width: int) -> list[tuple[int, int, int, int]]:
    """(left, top, right, bottom) of each tile in the resized image, row by row."""
    return [(column * tile_width, row * tile_height, (column + 1) * tile_width, (row + 1) * tile_height)
            for row in range(grid.rows) for column in range(grid.columns)]
