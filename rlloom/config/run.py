"""`RunConfig`, the whole run: one field per section, and the checks that span sections."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlloom.config.algorithm import AlgorithmConfig
from rlloom.config.checks import check
from rlloom.config.cluster import ClusterConfig
from rlloom.config.critic import CriticConfig
from rlloom.config.data import DataConfig
from rlloom.config.logging import LoggingConfig
from rlloom.config.model import ModelConfig
from rlloom.config.parallel import ParallelConfig
from rlloom.config.reward import RewardConfig
from rlloom.config.rollout import RolloutConfig
from rlloom.config.sync import TRANSPORT_OF_PLACEMENT, SyncConfig
from rlloom.config.teacher import TeacherConfig
from rlloom.config.train import TrainEngineConfig
from rlloom.config.trainer import TrainerConfig


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """The whole run: one field per component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)

    @property
    def critic_model_path(self) -> str:
        """The checkpoint PPO's critic starts from: critic.model_path, or the policy's model.path."""
        return self.critic.model_path or self.model.path

    @property
    def longest_sequence(self) -> int:
        """Most tokens one rollout sequence can hold: prompt + response, or for multi-turn episodes
        the trajectory's context budget (rollout.max_total_tokens, or its derived default)."""
        ro = self.rollout
        if not ro.multi_turn:
            return self.data.max_prompt_length + ro.max_new_tokens
        per_turn = ro.max_new_tokens + ro.max_observation_tokens
        return ro.max_total_tokens or self.data.max_prompt_length + ro.max_turns * per_turn

    def __post_init__(self) -> None:
        _check_parallel_world(self.parallel, self.cluster)
        self._check_micro_batches()
        if self.data.task in ("jsonl", "parquet"):
            check(
                bool(self.data.path),
                "data.path",
                self.data.path,
                f"data.task={self.data.task} needs a dataset file",
                "set data.path=/path/to/file",
            )
        if self.algorithm.estimator in ("grpo", "dr_grpo", "rloo") and self.rollout.n_samples < 2:
            check(
                False,
                "rollout.n_samples",
                self.rollout.n_samples,
                f"estimator {self.algorithm.estimator} needs groups of 2 or more",
                "set rollout.n_samples=4 or more",
            )
        self._check_modes()
        self._check_rollout_replicas()
        self._check_sync_transport()
        self._check_step_batch()
        if self.rollout.match_training:
            self._check_match_training()

        self._check_teacher()

    def _check_micro_batches(self) -> None:
        """What context and pipeline parallelism ask of the training micro-batches."""
        check(  # the same rule as rlloom.parallel.cp.check_cp_layout, at start-up
            self.parallel.cp == 1 or self.train.share_prompts is not True,
            "train.share_prompts",
            self.train.share_prompts,
            f"parallel.cp={self.parallel.cp} splits plain packed documents, not shared-prompt trees",
            "set train.share_prompts=false (or parallel.cp=1)",
        )
        longest = self.longest_sequence
        check(
            self.parallel.pp == 1 or self.train.max_tokens_per_micro_batch >= longest,
            "train.max_tokens_per_micro_batch",
            self.train.max_tokens_per_micro_batch,
            f"parallel.pp={self.parallel.pp} pads every micro-batch to this budget, so it must hold the longest "
            f"sample: data.max_prompt_length + rollout.max_new_tokens = {self.data.max_prompt_length} + "
            f"{self.rollout.max_new_tokens} = {longest}",
            f"set train.max_tokens_per_micro_batch={longest} or more (or lower those)",
        )
        shares, budget = self.parallel.cp * self.parallel.tp, self.train.max_tokens_per_micro_batch
        check(
            self.parallel.pp == 1 or budget % shares == 0,
            "train.max_tokens_per_micro_batch",
            budget,
            f"parallel.pp={self.parallel.pp} splits every micro-batch, padded to this budget, into "
            f"parallel.cp x parallel.tp = {self.parallel.cp} x {self.parallel.tp} equal token shares, so it must "
            f"be a multiple of {shares}",
            f"set train.max_tokens_per_micro_batch={-(-budget // shares) * shares}",
        )

    def _check_modes(self) -> None:
        """Settings that act only in the asynchronous modes."""
        check(
            self.rollout.partial == "finish" or self.trainer.mode == "async",
            "rollout.partial",
            self.rollout.partial,
            "abort_resume and drop act on requests in flight across a weight update: they need "
            "trainer.mode=async",
            "set trainer.mode=async, or rollout.partial=finish",
        )
        check(
            not self.algorithm.decoupled_ppo or self.trainer.mode != "sync",
            "algorithm.decoupled_ppo",
            self.algorithm.decoupled_ppo,
            "needs trainer.mode=one_step_off or async (in sync mode the proximal and behaviour policies "
            "are the same weights)",
            "set trainer.mode=async, or algorithm.decoupled_ppo=false",
        )

    def _check_step_batch(self) -> None:
        """Settings bounded by a step's batch or a response's length."""
        check(
            self.algorithm.overlong_buffer <= self.rollout.max_new_tokens,
            "algorithm.overlong_buffer",
            self.algorithm.overlong_buffer,
            f"must be at most rollout.max_new_tokens={self.rollout.max_new_tokens} (the penalty ramps over "
            "the last overlong_buffer tokens a response may have)",
            f"lower algorithm.overlong_buffer (e.g. {self.rollout.max_new_tokens // 4}) or raise rollout.max_new_tokens",
        )
        batch = self.trainer.prompts_per_step * self.rollout.n_samples
        check(
            self.algorithm.kl_ctrl == "fixed" or self.algorithm.kl_horizon > 0.2 * batch,
            "algorithm.kl_horizon",
            self.algorithm.kl_horizon,
            f"must be more than 0.2 x the {batch} samples of a step, or the adaptive KL coefficient can turn "
            "negative (it changes by up to 20% of samples / kl_horizon a step)",
            f"set algorithm.kl_horizon to {max(10000, 10 * batch)} or more",
        )
        check(
            batch % self.trainer.num_mini_batches == 0,
            "trainer.num_mini_batches",
            self.trainer.num_mini_batches,
            f"must divide the batch of {batch} completions",
            "pick a divisor of prompts_per_step x n_samples",
        )

    @property
    def uses_teacher(self) -> bool:
        """On-policy distillation is on: estimator opd, or a distillation term (distill_coef > 0)."""
        return self.algorithm.estimator == "opd" or self.algorithm.distill_coef > 0

    def _check_teacher(self) -> None:
        """Distillation needs a teacher, and a teacher needs distillation (it would load for nothing)."""
        algo = self.algorithm
        check(
            bool(self.teacher.path) or not self.uses_teacher,
            "teacher.path",
            self.teacher.path,
            f"algorithm.estimator={algo.estimator} with algorithm.distill_coef={algo.distill_coef} distills "
            "from a teacher",
            "set teacher.path to a Hugging Face folder with the student's tokenizer",
        )
        check(
            not self.teacher.path or self.uses_teacher,
            "teacher.path",
            self.teacher.path,
            "a teacher is used only by algorithm.estimator=opd or algorithm.distill_coef > 0",
            "set algorithm.estimator=opd (or algorithm.distill_coef, e.g. 0.5), or leave teacher.path empty",
        )

    def _check_sync_transport(self) -> None:
        """sync.transport is the one the placement runs (TRANSPORT_OF_PLACEMENT), or auto."""
        placement, transport = self.cluster.placement, self.sync.transport
        runs = TRANSPORT_OF_PLACEMENT[placement]
        if transport in ("auto", runs):
            return
        needs = {t: p for p, t in TRANSPORT_OF_PLACEMENT.items()}[transport]
        prerequisites = (
            " (with cluster.mode=ray and cluster.rollout_workers >= 1)" if needs == "separate" else ""
        )
        check(
            False,
            "sync.transport",
            transport,
            f"cluster.placement={placement} runs only the {runs} transport, and {transport} needs "
            f"cluster.placement={needs}",
            f"set sync.transport=auto (or {runs}), or cluster.placement={needs}{prerequisites}",
        )

    def _check_match_training(self) -> None:
        """rollout.match_training: the layouts whose logprobs are exact in this version."""
        r, p = self.rollout, self.parallel
        check(
            r.temperature == 1.0,
            "rollout.temperature",
            r.temperature,
            "rollout.match_training needs 1.0 (the sampler divides by it and the training head "
            "multiplies by its inverse: two roundings)",
            "set rollout.temperature=1.0 or rollout.match_training=false",
        )
        check(
            r.quantization == "none",
            "rollout.quantization",
            r.quantization,
            "rollout.match_training needs the rollout's weights to be training's",
            "set rollout.quantization=none",
        )
        # Exact layouts (models/exact.py): data and expert parallelism (a rank's forward is one
        # process's; the all-to-alls move rows and sum nothing), and tp=2 into rollout.tp=2, where both
        # engines sum a row-parallel product's two partials (a + b = b + a) and take the log-softmax of
        # the gathered logits. Not cp/pp, other tensor-parallel degrees, tp with ep, or tp into a
        # rollout of another tp (the partial sums split K otherwise: measured 4.8e-7 on the CPU).
        tp_ok = (p.tp, r.tp) in ((1, 1), (2, 2)) and not (p.tp > 1 and p.ep > 1)
        check(
            tp_ok and p.cp == p.pp == 1,
            "rollout.match_training",
            True,
            "its exact numerics cover data and expert parallelism and parallel.tp=2 into rollout.tp=2 "
            f"in this version (rollout.tp={r.tp}, parallel tp/cp/pp/ep={p.tp}/{p.cp}/{p.pp}/{p.ep})",
            "set parallel.tp and rollout.tp to 1 or both to 2 (without parallel.ep), cp and pp to 1, or "
            "rollout.match_training=false",
        )

    def _check_rollout_replicas(self) -> None:
        """The rollout ranks split into whole replicas of rollout.tp ranks each."""
        tp = self.rollout.tp
        c = self.cluster
        ranks, key = (
            (c.rollout_workers, "cluster.rollout_workers")
            if c.placement == "separate"
            else (c.num_workers, "cluster.num_workers")
        )
        check(
            ranks % tp == 0,
            key,
            ranks,
            f"the rollout ranks form replicas of rollout.tp={tp} ranks each, so it must be a multiple of {tp}",
            f"set {key} to a multiple of {tp}, or change rollout.tp",
        )


def _check_parallel_world(par: ParallelConfig, cluster: ClusterConfig) -> None:
    """cluster.num_workers = pp x dp x cp x tp (dp is what is left); ep divides dp x cp x tp. A fix
    that asks for more workers also names cluster.mode=ray when the run is inline, so that one
    message lists every prerequisite of the degrees."""
    num_workers = cluster.num_workers
    ray = ", with cluster.mode=ray (more than one worker)" if cluster.mode == "inline" else ""
    others = par.pp * par.cp * par.tp
    factors = f"(pp={par.pp}, cp={par.cp}, tp={par.tp}, ep={par.ep}, cluster.num_workers={num_workers})"
    check(
        num_workers % others == 0,
        "cluster.num_workers",
        num_workers,
        f"must be divisible by pp x cp x tp = {par.pp} x {par.cp} x {par.tp} = {others} (num_workers = "
        f"pp x dp x cp x tp, dp is what is left) {factors}",
        f"use cluster.num_workers={others * max(1, -(-num_workers // others))} or degrees whose product divides "
        f"{num_workers}{ray}",
    )
    pool = num_workers // par.pp
    dp = pool // (par.cp * par.tp)
    check(
        pool % par.ep == 0,
        "parallel.ep",
        par.ep,
        f"must divide dp x cp x tp = {dp} x {par.cp} x {par.tp} = {pool}, the ranks expert parallelism "
        f"borrows {factors}",
        f"use a parallel.ep that divides {pool}, or cluster.num_workers={par.pp * math.lcm(pool, par.ep)}{ray}",
    )
