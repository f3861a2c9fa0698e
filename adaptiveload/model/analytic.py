"""Analytic FLOPs, memory and step time of Wan 2.1 training micro-batches.

Counted from the shapes of `adaptiveload.model.wan` (one bucket shape per micro-batch, B
samples of S tokens, text length L). These numbers are labelled `model`: they are what the
shipped priors are built from and what a CPU calibration falls back to for memory.

FLOPs (multiply-add = 2 FLOPs), forward, per sample:
- linear:    per token, 2 x (4 d^2 self-attn + 2 d^2 cross q/o + 2 d f FFN) per block, plus the
             patch embedding, the head and the cross-attention core (4 L d per token);
- attention: per token^2, 4 d per block (Q K^T and A V);
- per sample: the text embedding and every block's cross-attention k/v projections (4 L d^2),
              independent of S.
Training: backward = 2 x forward (the usual model-FLOPs accounting), activation checkpointing
recomputes one more forward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from adaptiveload.model.architectures import WanConfig

FP32 = 4  # bytes: the residual stream, LayerNorm statistics, modulation (Wan keeps them fp32)


@dataclass(frozen=True)
class FlopTerms:
    """Forward FLOPs of one sample of S tokens: linear*S + attention*S^2 + per_sample."""

    linear: float
    attention: float
    per_sample: float

    def forward(self, tokens: float) -> float:
        return self.linear * tokens + self.attention * tokens**2 + self.per_sample


def flop_terms(cfg: WanConfig, text_len: int | None = None) -> FlopTerms:
    d, f, n = cfg.dim, cfg.ffn_dim, cfg.num_layers
    L = cfg.text_len if text_len is None else text_len
    per_block_token = 2 * (4 * d * d + 2 * d * d + 2 * d * f) + 4 * L * d
    embed_token = 2 * d * (cfg.in_dim + cfg.out_dim) * cfg.patch_volume
    text = 2 * L * (cfg.text_dim * d + d * d)
    time = 2 * (cfg.freq_dim * d + d * d + 6 * d * d)
    return FlopTerms(
        linear=n * per_block_token + embed_token,
        attention=n * 4 * d,
        per_sample=n * 4 * L * d * d + text + time,
    )


def training_flops(
    cfg: WanConfig,
    batch: float,
    tokens: float,
    text_len: int | None = None,
    activation_checkpointing: bool = False,
) -> float:
    """Forward+backward FLOPs of a micro-batch (x4/3 with checkpointing's recomputation)."""
    passes = 4 if activation_checkpointing else 3
    return passes * batch * flop_terms(cfg, text_len).forward(tokens)


def compute_bytes(device: str) -> int:
    """The bytes of an activation element as this project trains on `device` ("cuda..." or
    "cpu..."): bf16 autocast on CUDA, as Wan trains; fp32 on CPU, where bf16 matmuls are slow
    and the CPU runs exist to check the code, not to be fast."""
    return 2 if str(device).startswith("cuda") else FP32


@dataclass(frozen=True)
class TrainingSetup:
    """What the memory model assumes about how the model is trained."""

    compute_bytes: int = 2  # autocast dtype of Linears/attention: 2 = bf16, 4 = fp32 training
    activation_checkpointing: bool = True  # per block
    state_bytes_per_param: int = 16  # fp32 weights + fp32 grads + AdamW m and v
    shard_world_size: int = 1  # ranks the static state is sharded over (ZeRO-3/FSDP); 1 = DDP


def activation_bytes_per_token_block(cfg: WanConfig, setup: TrainingSetup) -> float:
    """Bytes autograd keeps per token per block, counted tensor by tensor from `wan.Block`.

    R = fp32 (residual stream, LayerNorm, RMSNorm statistics, RoPE output), C = compute dtype.
    Under autocast each Linear casts its own copy of a shared fp32 input (hence the 3 C of q/k/v).
    """
    R, C, d, f = FP32, setup.compute_bytes, cfg.dim, cfg.ffn_dim
    cast = R if C == R else C  # a Linear's saved input: the fp32 tensor itself, or its cast
    self_attn = (
        2 * R  # LayerNorm input, normalised x (kept for d scale)
        + (R if C == R else 3 * C)  # modulated input of q, k, v
        + 2 * (R + C)  # q/k RMSNorm: fp32 input, normalised (for its weight)
        + 4 * C  # attention: q, k, v, output
        + C  # o projection input (heads flattened)
        + C  # o output, kept for d gate
    )
    cross_attn = R + cast + (R + C) + 2 * C + C  # norm3, q input, RMSNorm, q & out, o input
    ffn_d = 2 * R + cast + C  # LN input + normalised, fc1 input, fc2 output (for d gate)
    ffn_f = 2 * C  # GELU input, fc2 input
    return d * (self_attn + cross_attn + ffn_d) + f * ffn_f


def activation_bytes_per_sample_block(
    cfg: WanConfig, setup: TrainingSetup, text_len: int | None = None
) -> float:
    """Per block and sample, independent of S: cross-attention keys and values of the text."""
    L = cfg.text_len if text_len is None else text_len
    R, C = FP32, setup.compute_bytes
    # k projection output and its RMSNorm (fp32 input, normalised), v, attention's k and v
    return L * cfg.dim * (C + (R + C) + C + 2 * C)


def memory_terms(
    cfg: WanConfig, num_params: int, setup: TrainingSetup, text_len: int | None = None
) -> tuple[float, float, float]:
    """(m_static, m_tok, m_seq) of `m(B,S) = m_static + B (m_tok S + m_seq)`, in bytes.

    Peak = static state + saved activations + one block's activations (with checkpointing:
    the block being recomputed in backward; without: already counted). Outside the blocks we
    count the latent patches, the patch-embedding output and the head (a few R*d per token).
    """
    L = cfg.text_len if text_len is None else text_len
    C, n, d = setup.compute_bytes, cfg.num_layers, cfg.dim
    static = num_params * setup.state_bytes_per_param / setup.shard_world_size
    if C < FP32:  # autocast keeps a low-precision copy of the weights during the step
        static += num_params * C / setup.shard_world_size
    block_tok = activation_bytes_per_token_block(cfg, setup)
    block_seq = activation_bytes_per_sample_block(cfg, setup, L)
    outside_tok = FP32 * (cfg.in_dim * cfg.patch_volume + 4 * d)
    text_seq = L * (cfg.text_dim * (FP32 + C) + 2 * d * C)
    if setup.activation_checkpointing:
        m_tok = n * FP32 * d + block_tok + outside_tok  # block inputs + one block recomputed
        m_seq = block_seq + text_seq
    else:
        m_tok = n * block_tok + outside_tok
        m_seq = n * block_seq + text_seq
    return float(static), float(m_tok), float(m_seq)


@dataclass(frozen=True)
class DeviceRates:
    """A device's measured peak rates and the fractions of them the model's kernels reach."""

    name: str
    matmul_flops: float  # dense bf16 GEMM rate, FLOP/s
    copy_bytes_per_s: float  # device-memory copy bandwidth
    capacity_bytes: float
    linear_efficiency: float  # Linear layers' GEMMs, share of matmul_flops
    attention_efficiency: float  # FlashAttention forward+backward, share of matmul_flops
    memory_efficiency: float  # element-wise ops (norms, modulation, RoPE, GELU), share of copy
    traffic_per_activation_byte: float  # HBM bytes moved fwd+bwd per saved activation byte
    step_overhead_s: float  # launches, Python, per micro-batch

    def to_dict(self) -> dict:
        return asdict(self)


# Rates: bf16 dense GEMM measured ~790 TFLOP/s (the datasheet's 989 is not reached), copy
# ~4.3 TB/s, 141 GB HBM3e. Efficiencies are assumptions, stated: the model's GEMMs (1536-5120
# wide, long M) reach ~80% of the measured GEMM rate; FlashAttention-2/3 fwd+bwd with head dim
# 128 about 50% (its backward is 2.5x, not 2x, the forward's GEMM work); element-wise kernels
# ~70% of copy bandwidth, moving ~3 bytes per saved activation byte (written forward, read in
# backward, plus the gradient written); ~3 ms of per-micro-batch overhead.
H200 = DeviceRates(
    name="NVIDIA H200 (analytic prior)",
    matmul_flops=790e12,
    copy_bytes_per_s=4.3e12,
    capacity_bytes=141e9,
    linear_efficiency=0.8,
    attention_efficiency=0.5,
    memory_efficiency=0.7,
    traffic_per_activation_byte=3.0,
    step_overhead_s=0.003,
)

PRIORS = {"h200": H200}


def step_time(
    cfg: WanConfig,
    rates: DeviceRates,
    setup: TrainingSetup,
    batch: float,
    tokens: float,
    text_len: int | None = None,
) -> float:
    """Predicted forward+backward seconds of a micro-batch on `rates`' device (a `model` number)."""
    terms = flop_terms(cfg, text_len)
    passes = 4 if setup.activation_checkpointing else 3
    gemm = passes * (terms.linear * tokens + terms.per_sample)
    attn = passes * terms.attention * tokens**2
    traffic = (
        rates.traffic_per_activation_byte
        * cfg.num_layers
        * activation_bytes_per_token_block(cfg, setup)
        * tokens
        * (passes / 3)
    )
    per_sample = (
        gemm / (rates.matmul_flops * rates.linear_efficiency)
        + attn / (rates.matmul_flops * rates.attention_efficiency)
        + traffic / (rates.copy_bytes_per_s * rates.memory_efficiency)
    )
    return rates.step_overhead_s + batch * per_sample
