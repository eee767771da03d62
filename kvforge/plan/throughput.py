"""Roofline bounds on decode and prefill speed for a TP x PP split.

A stage's step takes max(bytes read / HBM bandwidth, FLOPs / matrix throughput), plus, under tensor
parallelism, two all-reduces per layer (after attention and after the MLP; one more after the embedding)
that are not overlapped with compute. A ring all-reduce of S bytes over tp ranks moves 2 (tp - 1) / tp x S
per rank; each collective also pays a fixed latency. Pipeline stages hand the hidden state and residual
to the next stage (one send each way of a step).

Decode with pp stages keeps m = min(pp, batch) micro-batches in flight (the engine's virtual engines):

    stage 0   [mb0][mb1][mb0][mb1]            one round = every sequence advances one token:
    stage 1        [mb0][mb1][mb0][mb1]       max(m x slowest stage, sum of stages + sends)

so with batch >= pp no stage idles (no bubble) and with batch < pp, (pp - m) / pp of each stage idles.
Prefill runs chunks of max_num_batched_tokens tokens back to back, so stages stay busy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvforge.plan.devices import DeviceSpec
from kvforge.plan.model_shape import ModelShape
from kvforge.plan.precision import Precision
from kvforge.plan.stage import Stage


@dataclass(frozen=True, slots=True)
class StepTime:
    """Seconds of one stage step and what they are made of."""

    memory_s: float
    compute_s: float
    comm_s: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s) + self.comm_s

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


@dataclass(frozen=True, slots=True)
class SpeedEstimate:
    """Upper bounds on speed: aggregate tokens/s over all devices, and the latency a sequence sees."""

    tokens_per_s: float
    latency_ms: float  # decode: time per output token; prefill: time to first token of one prompt
    bound: str  # "memory" or "compute", in the slowest stage
    comm_share: float  # share of the slowest stage's step spent in collectives


@dataclass(frozen=True, slots=True)
class Roofline:
    shape: ModelShape
    device: DeviceSpec
    precision: Precision
    tp: int

    def all_reduce_s(self, num_tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        size = num_tokens * self.shape.hidden_size * self.precision.activation_bytes
        ring = 2 * (self.tp - 1) / self.tp * size / (self.device.interconnect_gbs * 1e9)
        return self.device.collective_latency_us * 1e-6 + ring

    def send_s(self, num_tokens: int) -> float:
        """Hand the hidden state and the residual of num_tokens to the next stage."""
        size = 2 * num_tokens * self.shape.hidden_size * self.precision.activation_bytes
        return self.device.collective_latency_us * 1e-6 + size / (self.device.interconnect_gbs * 1e9)

    def step(self, stage: Stage, num_tokens: int, context: float, num_sampled: int, experts_read: float) -> StepTime:
        """One step of num_tokens tokens, each attending over `context` tokens on average."""
        weights_read = stage.weight_bytes - stage.lookup_bytes - stage.expert_bytes * (1 - experts_read)
        kv_read = num_tokens * context * stage.kv_bytes_per_token
        flops = (2 * num_tokens * stage.active_params + 2 * num_sampled * stage.lm_head_params
                 + num_tokens * context * stage.decode_attn_flops)  # fmt: skip
        num_all_reduces = 2 * stage.num_layers + (1 if stage.is_first else 0)
        return StepTime(
            memory_s=(weights_read + kv_read) / (self.device.peak.memory_bandwidth_gbs * 1e9),
            compute_s=flops / (self.precision.matmul_tflops(self.device) * 1e12),
            comm_s=num_all_reduces * self.all_reduce_s(num_tokens),
        )

    def prefill_step(self, stage: Stage, num_tokens: int, context: int) -> StepTime:
        """A chunk of num_tokens prompt tokens of prompts of `context` tokens: causal attention over half
        the prompt on average, the LM head for each prompt's last token, every expert read."""
        step = self.step(stage, num_tokens, 0, math.ceil(num_tokens / context), 1.0)
        attention = num_tokens * context / 2 * stage.prefill_attn_flops
        compute = step.compute_s + attention / (self.precision.matmul_tflops(self.device) * 1e12)
        return StepTime(step.memory_s, compute, step.comm_s)

    def experts_read(self, num_tokens: int) -> float:
        """Expected share of an MoE layer's experts that num_tokens tokens choose (uniform routing)."""
        if not self.shape.num_experts:
            return 1.0
        return 1 - (1 - self.shape.top_k / self.shape.num_experts) ** num_tokens


def decode_speed(roofline: Roofline, stages: list[Stage], batch: int, context: int) -> SpeedEstimate:
    """Decode of `batch` sequences at `context` tokens each."""
    pp = len(stages)
    num_micro = min(pp, batch)
    micro = math.ceil(batch / num_micro)
    steps = [roofline.step(s, micro, context, micro, roofline.experts_read(micro)) for s in stages]
    send = roofline.send_s(micro) if pp > 1 else 0.0
    slowest = max(steps, key=lambda step: step.seconds)
    round_s = max(num_micro * slowest.seconds, sum(step.seconds for step in steps) + (pp - 1) * send)
    return SpeedEstimate(batch / round_s, round_s * 1e3, slowest.bound, slowest.comm_s / slowest.seconds)


def prefill_speed(roofline: Roofline, stages: list[Stage], context: int, max_num_batched_tokens: int
                  ) -> SpeedEstimate:  # fmt: skip
    """Prefill of prompts of `context` tokens in chunks of max_num_batched_tokens; the latency is the
    time to first token of one prompt alone (its chunks one after another through every stage)."""
    pp = len(stages)
    chunk = max_num_batched_tokens
    steps = [roofline.prefill_step(s, chunk, context) for s in stages]
    send = roofline.send_s(chunk) if pp > 1 else 0.0
    slowest = max(steps, key=lambda step: step.seconds)
    tokens_per_s = chunk / (slowest.seconds + send)
    alone = min(chunk, context)
    alone_steps = [roofline.prefill_step(s, alone, context) for s in stages]
    sends = (pp - 1) * roofline.send_s(alone) if pp > 1 else 0.0
    ttft = math.ceil(context / chunk) * (sum(step.seconds for step in alone_steps) + sends)
    return SpeedEstimate(tokens_per_s, ttft * 1e3, slowest.bound, slowest.comm_s / slowest.seconds)
