"""The search's parameters (TVM's SketchPolicy params), one object passed as itself to the policy,
the sketch rules and the annotation code, so each default is written here only."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SearchParams:
    """TVM's defaults, plus the crossover rate (TVM never shipped crossover), except the widest loop
    annotation vectorises (`max_vectorize_size`): TVM's 16 leaves an innermost tile of 32 or 64 floats
    to LLVM's own vectoriser, which sometimes vectorises across the tile's rows with gathers and scatters
    (a matmul's 8x32 accumulator tile ran at 8 GFLOP/s, 444 with the annotation). Our code generator
    emits any width as whole vectors, so every innermost tile the splits may draw (64) is vectorised.
    `python -m bench space`, 128 random programs each, two seeds, Zen 5 (AVX-512): the fastest matmul
    1024^3 ran 454 / 449 GFLOP/s with 64 and 393 / 425 with 16, its 90th percentile 341 / 372 against
    223 / 262; the NCHW ResNet-18 conv 436 / 429 against 269 / 332 (docs/performance.md)."""
    population: int = 2048
    num_iters: int = 4
    mutation_prob: float = 0.85
    crossover_prob: float = 0.05
    eps_greedy: float = 0.05
    num_measures_per_round: int = 64
    sample_init_population: int = 2048
    sample_init_use_measured_ratio: float = 0.2
    max_innermost_split_factor: int = 64
    max_vectorize_size: int = 64
    disable_change_compute_location: bool = False
    disable_cpu_packing: bool = False          # CPU: no packed-operand sketches (add_cache_read_pack)
    cpu_multi_level_tiling_structure: str = "SSRSRS"
    gpu_multi_level_tiling_structure: str = "SSSRRSRS"
    mutation_weights: dict[str, float] = field(default_factory=lambda: {
        "tile_size": 0.90, "auto_unroll": 0.04, "compute_location": 0.05, "parallel": 0.01})
