"""`ParallelLayout`: the one description of how a run is split over ranks (plain data, no torch).

    layout = ParallelLayout.for_world(16, tp=2, pp=2, cp=2)     # dp = 16 / (2 * 2 * 2) = 2
    layout.sequence_multiple    # 4: CP cuts every sequence into 2 * cp chunks
    layout.row_multiple         # 1: no sequence parallelism (with it: cp * tp)

The planner (`StepPlanConfig.layout`), the padding rule (`PaddingRule`), the Hydra ``parallel`` group
(`app.config.ParallelConfig.layout`) and the Megatron model builder (`megatron.model`) all read the
sizes from here, so the CP padding rule, the sequence-parallel rule and the world-size check exist once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..validators import require_positive_int

__all__ = ["SINGLE_RANK", "ParallelLayout", "check_dynamic_cp_layout"]


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Sizes of the parallel dimensions.

    Attributes:
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        cp: context-parallel size; > 1 cuts every sequence into 2*cp load-balanced chunks.
        dp: data-parallel size (replicas of the model; with CP, DP x CP ranks share the gradient reduction).
        sequence_parallel: Megatron sequence parallelism (splits each CP shard's tokens over TP ranks).
        ep: expert-parallel size (Mixture-of-Experts): the experts of each layer are split over ``ep`` of
            the DP x CP ranks of one TP/PP position (Megatron's expert grid: expert TP = tp, so
            ``dp * cp = ep * expert-data-parallel``); attention and dense layers are unchanged.
        etp: expert tensor-parallel size (Megatron's ``expert_tensor_parallel_size``): None is tp (each
            expert cut over the TP ranks like a dense MLP); 1 keeps every expert whole, its TP ranks then
            joining the expert-data-parallel ranks (experts with biases, GPT-OSS, need it at tp > 1).
        vpp: virtual pipeline size: model chunks per pipeline stage (Megatron's interleaved 1F1B
            schedule, ``virtual_pipeline_model_parallel_size``); 1 is the plain schedule. Needs pp > 1.
        microbatch_group_size_per_vp_stage: under vpp > 1, how many micro-batches run through one chunk
            before the next (Megatron's key; None is pp). Each rank's micro-batch count is planned a
            multiple of it (`microbatch_multiple`).
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    ep: int = 1
    etp: int | None = None
    vpp: int = 1
    microbatch_group_size_per_vp_stage: int | None = None

    def __post_init__(self):
        for name in ("tp", "pp", "cp", "dp", "ep", "vpp"):
            require_positive_int(name, getattr(self, name))
        if self.etp not in (None, 1, self.tp):
            raise ValueError(f"etp={self.etp}: expert tensor parallelism is 1 (whole experts) or tp={self.tp} (unset).")
        require_positive_int("microbatch_group_size_per_vp_stage", self.microbatch_group_size_per_vp_stage,
                             allow_none=True)  # fmt: skip
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(
                f"vpp={self.vpp} interleaves model chunks over pipeline stages, but pp=1: set pp > 1, or vpp=1."
            )
        if self.vpp > 1 and self.microbatch_group < self.pp:
            raise ValueError(
                f"microbatch_group_size_per_vp_stage={self.microbatch_group_size_per_vp_stage} must be at least "
                f"pp={self.pp} (Megatron's interleaved schedule needs a group to fill the pipeline); leave it unset "
                "for pp."
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=true needs tp > 1 (it splits tokens over TP ranks).")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp x cp = {self.dp} x {self.cp}: expert parallelism splits the experts "
                "over the data- and context-parallel ranks of each TP/PP position. Launch more ranks or lower ep."
            )

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, sequence_parallel: bool = False,
                  ep: int = 1, vpp: int = 1, microbatch_group_size_per_vp_stage: int | None = None,
                  etp: int | None = None, keys: str = "tp x pp x cp") -> ParallelLayout:  # fmt: skip
        """The layout of ``world_size`` ranks (DP is what remains); an error names ``keys`` (the caller's
        spelling of tp, pp and cp) when the world does not factor."""
        model_parallel = tp * pp * cp
        if world_size % model_parallel:
            raise ValueError(
                f"World size {world_size} does not factor into {keys} x DP = {tp} x {pp} x {cp} x DP. Launch a "
                f"multiple of {model_parallel} ranks, or change the sizes."
            )
        return cls(tp=tp, pp=pp, cp=cp, dp=world_size // model_parallel, sequence_parallel=sequence_parallel, ep=ep,
                   etp=etp, vpp=vpp, microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage)  # fmt: skip

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size: ``etp``, or tp when unset."""
        return self.tp if self.etp is None else self.etp

    @property
    def microbatch_group(self) -> int:
        """Micro-batches per group of the interleaved schedule (``microbatch_group_size_per_vp_stage``, or pp)."""
        group = self.microbatch_group_size_per_vp_stage
        return self.pp if group is None else group

    @property
    def microbatch_multiple(self) -> int:
        """Each DP rank's micro-batch count is a multiple of this: the group size under vpp > 1 (Megatron's
        interleaved schedule runs whole groups, at least one), else 1."""
        return self.microbatch_group if self.vpp > 1 else 1

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one replica: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    @property
    def world_size(self) -> int:
        return self.model_parallel_size * self.dp

    @property
    def sequence_multiple(self) -> int:
        """Every sequence's padded length is a multiple of this: 2*cp under CP (chunks r and 2cp-1-r), else 1."""
        return 2 * self.cp if self.cp > 1 else 1

    @property
    def row_multiple(self) -> int:
        """A row's length is a multiple of this: cp * tp with sequence parallelism (each CP shard splits over
        TP ranks), else 1."""
        return self.cp * self.tp if self.sequence_parallel else 1

    def check_heads(self, num_attention_heads: int, num_query_groups: int) -> None:
        """Every tensor-parallel rank holds whole query heads and whole key/value groups; context
        parallelism puts no condition on heads (keys and values are all-gathered over CP)."""
        named = (("model.num_attention_heads", num_attention_heads), ("model.num_query_groups", num_query_groups))
        for key, heads in named:
            if heads % self.tp:
                raise ValueError(
                    f"{key}={heads} heads cannot be split over parallel.tp={self.tp}: every tensor-parallel rank "
                    f"holds whole heads. Use a TP size that divides {heads}."
                )

    def check_layers(self, num_layers: int) -> None:
        """Every model chunk (pp x vpp of them) holds the same number of whole layers."""
        chunks = self.pp * self.vpp
        if num_layers % chunks:
            raise ValueError(
                f"model.num_layers={num_layers} cannot be split into pp x vpp = {self.pp} x {self.vpp} = {chunks} "
                f"equal model chunks. Use a pp and vpp whose product divides {num_layers}."
            )

    def check_experts(self, num_experts: int | None, *, biased: bool = False) -> None:
        """Every expert-parallel rank holds whole experts; ep > 1 needs a Mixture-of-Experts model; experts
        with biases (``biased``: GPT-OSS) need expert TP 1 (Megatron-Core has expert biases only there)."""
        if biased and self.expert_tp > 1:
            raise ValueError(f"parallel.tp={self.tp}: this model's experts have biases (GPT-OSS), which Megatron-Core "
                             "supports only at expert tensor parallelism 1: set parallel.etp=1 (each expert whole on "
                             "its rank).")  # fmt: skip
        if num_experts is None:
            if self.ep > 1:
                raise ValueError(f"parallel.ep={self.ep} splits experts, but the model is dense (model.num_experts "
                                 "is not set): use parallel.ep=1.")  # fmt: skip
            return
        if self.tp > 1 and not self.sequence_parallel:
            raise ValueError(
                f"a Mixture-of-Experts model at parallel.tp={self.tp} needs parallel.sequence_parallel=true: "
                "Megatron's MoE layer dispatches each TP rank's own share of the tokens."
            )
        if num_experts % self.ep:
            raise ValueError(
                f"model.num_experts={num_experts} cannot be split over parallel.ep={self.ep}: every expert-parallel "
                f"rank holds whole experts. Use an ep that divides {num_experts}."
            )

    def to_dict(self) -> dict:
        return asdict(self)


SINGLE_RANK = ParallelLayout()
"""One rank: the default layout of functions that take one."""


def check_dynamic_cp_layout(layout: ParallelLayout, *, key: str = "context_parallel.dynamic", cp_key: str = "cp",
                            pp_key: str = "pp") -> None:  # fmt: skip
    """The layouts dynamic CP runs on: a power-of-two ``cp`` and ``pp = 1`` (ValueError naming ``key`` and
    the layout's keys ``cp_key`` / ``pp_key``)."""
    if layout.cp & (layout.cp - 1):
        raise ValueError(f"{key} needs a power-of-two {cp_key} (sizes 1, 2, 4, ...); got {cp_key}={layout.cp}.")
    if layout.pp > 1:
        raise ValueError(
            f"{key} runs at {pp_key}=1 (got {pp_key}={layout.pp}): a row's ranks meet it at different positions of "
            "their micro-batch lists, and under a pipeline schedule a rank that waits there for its row's other ranks "
            f"also holds up its neighbouring stages, which can deadlock. Use {pp_key}=1, or static CP."
        )
