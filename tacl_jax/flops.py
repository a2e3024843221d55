"""Model FLOPs of a train step, for TFLOP/s and MFU (model FLOPs utilisation).

Counted (a matmul of ``[m, k] × [k, n]`` is ``2·m·k·n`` FLOPs; element-wise work is ignored):

* encoder forward per token: ``layers · (2·(4·d² + 2·d·I) + 4·L·d)`` — Q, K, V, O and the two
  FFN matmuls, plus bidirectional attention's ``QKᵀ`` and ``PV`` over all ``L`` keys;
* MLM head per *predicted slot* (gathered: ``P`` slots per sequence, not ``L``):
  ``2·(d·e + e·V)`` — the transform and the tied decoder (``e`` = ELECTRA's ``embedding_size``,
  else ``d``: ``2·(d² + d·V)``);
* ELECTRA's ``embeddings_project`` (``e != d``): ``2·e·d`` per token, in every encoder forward
  (student and teacher);
* student: forward + backward = 3 × forward (encoder + head);
* teacher (TaCL): one encoder forward, no head, no backward (its own size when it is another
  checkpoint, ``tacl.teacher_hf_path``);
* the learned projection into a larger teacher's size ``d_t``: ``2·d·d_t`` per anchor, forward
  and backward (3×);
* TaCL's scores: ``2·L·d_t`` per anchor (``d_t`` the teacher's hidden size; the predicted slots:
  only their scores are computed; ``anchors=L`` counts every position's, as the original computes
  them) forward and again backward (student side only; the teacher gets no gradient);
* with the gathered last layer (``model.gather_last_layer``: the student's last layer only at
  the ``P`` predicted positions, the only ones its losses read), that layer counts K and V per
  token (``2·2·d²``) and the rest per slot (``2·(2·d² + 2·d·I) + 4·L·d``): the FLOPs it does.

MFU = achieved model FLOP/s per device ÷ the device's peak dense bf16 FLOP/s (table below;
``config.metrics.peak_flops_per_device`` overrides it, e.g. for fp32 runs or unknown devices).
"""

from __future__ import annotations

# Peak dense bf16 FLOP/s per chip/GPU, from the vendors' spec sheets.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,   # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,   # v6e (Trillium)
    "TPU v6e": 918e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
}


def encoder_flops_per_token(layers: int, d: int, ffn: int, length: int) -> float:
    return layers * (2 * (4 * d * d + 2 * d * ffn) + 4 * length * d)


def mlm_head_flops(d: int, vocab: int, e: int | None = None) -> int:
    """Forward FLOPs of BERT's MLM head at one slot: the ``d × e`` transform and the tied ``e × V``
    decoder (``e``: the embeddings' width, ELECTRA's ``embedding_size``; default ``d``)."""
    e = d if e is None else e
    return 2 * (d * e + e * vocab)


def sequence_flops(cfg, *, length: int, predictions: int, teacher: bool, gathered_last_layer: bool = False,
                   anchors: int | None = None, teacher_cfg=None) -> dict[str, int]:
    """Model FLOPs of one train step's sequence of ``length`` tokens, by part (the module doc's
    formula; :func:`step_flops` is ``batch ×`` its ``total``). ``cfg``: anything with a
    ``BertConfig``'s ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``vocab_size``;
    ``predictions``: MLM slots per sequence; ``anchors``: TaCL anchors per sequence whose scores
    are computed (default ``predictions``); ``teacher_cfg``: the teacher's architecture when it is
    not the student's (then ``projection`` counts the student→teacher map).

    Parts (forward FLOPs unless said): ``layer_forward`` (one encoder layer at every position),
    ``student_forward`` (the encoder, gathered last layer or not, plus the MLM head),
    ``mlm_head_forward``, ``embeddings_project`` (ELECTRA's E -> H projection of the sequence; 0
    without one; in both forwards), ``teacher_forward`` (0 without a teacher), ``tacl`` (the scores,
    forward and backward; 0 without a teacher), ``projection`` (the student→teacher map, forward
    and backward; 0 unless the teacher's hidden size differs), ``total`` = 3 · student_forward +
    teacher_forward + tacl + projection."""
    d, ffn, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    e = getattr(cfg, "embedding_size", None) or d
    proj = 2 * e * d * length if e != d else 0
    p = predictions
    layer = encoder_flops_per_token(1, d, ffn, length) * length
    if gathered_last_layer:   # K and V at every position, the rest at the P slots
        last = 2 * 2 * d * d * length + (encoder_flops_per_token(1, d, ffn, length) - 2 * 2 * d * d) * p
    else:
        last = layer
    head = mlm_head_flops(d, cfg.vocab_size, e) * p
    student = proj + (n - 1) * layer + last + head
    t = teacher_cfg if teacher_cfg is not None else cfg
    d_t, a = t.hidden_size, (p if anchors is None else anchors)
    e_t = getattr(t, "embedding_size", None) or d_t
    teacher_fwd = ((2 * e_t * d_t * length if e_t != d_t else 0)
                   + t.num_hidden_layers * encoder_flops_per_token(1, d_t, t.intermediate_size, length) * length
                   if teacher else 0)
    tacl = 2 * 2 * length * d_t * a if teacher else 0
    projection = 3 * 2 * d * d_t * a if teacher and d_t != d else 0
    return dict(total=3 * student + teacher_fwd + tacl + projection, student_forward=student,
                teacher_forward=teacher_fwd, layer_forward=layer, mlm_head_forward=head, embeddings_project=proj,
                tacl=tacl, projection=projection)


def step_flops(cfg, *, batch: int, length: int, predictions: int, teacher: bool,
               gathered_last_layer: bool = False, anchors: int | None = None, teacher_cfg=None) -> float:
    """Model FLOPs of one optimizer step over a global batch of ``batch × length`` tokens.
    ``cfg`` is a ``BertConfig``; ``predictions`` = MLM slots per sequence;
    ``gathered_last_layer``: the student's last layer only at those slots; ``anchors``: TaCL
    anchors per sequence (default ``predictions``); ``teacher_cfg``: a teacher of another
    architecture (default ``cfg``). See :func:`sequence_flops`."""
    return float(batch * sequence_flops(cfg, length=length, predictions=predictions, teacher=teacher,
                                        gathered_last_layer=gathered_last_layer, anchors=anchors,
                                        teacher_cfg=teacher_cfg)["total"])


def peak_flops_of_kind(kind: str) -> float | None:
    """The table's peak for a device kind (``jax.Device.device_kind``: the target's, which for a
    compile-only topology is not this host's), None when unknown."""
    for name, peak in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if kind.lower().startswith(name.lower()):
            return peak
    return None
