"""The checkpoint section: saving, resuming, starting points, phases, with the rules about its own
fields and the keys that moved here from `train`."""
from __future__ import annotations

from dataclasses import dataclass

from .checks import non_negative


@dataclass
class CheckpointConfig:
    """Where checkpoints go and where a run starts from."""

    save_dir: str | None = None
    save_interval: int = 0  # 0 = only at end / on SIGTERM
    keep_last: int = 3  # checkpoints kept; 0 = keep all
    load_dir: str | None = None  # resume from the latest checkpoint here
    # start from another run's latest checkpoint (e.g. phase 2 from phase 1): its weights (and, with
    # init_optimizer_states, its optimizer moments), but step 0, new data position and LR schedule;
    # a checkpoint in load_dir takes precedence, so a restarted phase-2 run resumes itself
    init_from: str | None = None
    init_optimizer_states: bool = False
    # init_from is the previous phase of this training (ModernBERT's context extension, its decay):
    # its optimizer states too, and the phase may change the LR, schedule, batch, masking, sequence
    # length and rotary bases; the start-up log lists every setting it changes, and the tokens seen
    # count on from the previous phase's (pretrain/checkpoint/phases.py)
    new_phase: bool = False
    # init_from is a smaller ModernBERT: tile its weights "from the middle" into this run's larger
    # model (ModernBERT's tile_weights_from_middle, how ModernBERT-large started from base;
    # pretrain/checkpoint/tiling.py): weights only, step 0; the model's shape keys are this run's own
    init_tiled: bool = False
    # resume (or init_from) a checkpoint trained with another vocabulary than data.vocab_file: a
    # deliberate change (the embedding of a changed id keeps what it learnt for the old token).
    # Without it such a run is refused, naming both files
    accept_new_vocab: bool = False
    # resume although the data settings that define the sample sequence (data.paths, weights, split,
    # seq_length, masking, segment pairs, seed...) differ from the checkpoint's: weights, optimizer,
    # step and LR schedule resume, the new sequence starts over from its first sample. Without it
    # such a resume is refused, naming the keys (a new phase uses init_from instead)
    accept_new_data: bool = False
    # write into a save_dir that holds another run's checkpoints (a run starting from scratch or
    # from init_from there, or resuming another directory's series into it): this run's saves
    # replace the checkpoints of the same steps, the others stay (retention removes only the run's
    # own). Without it such a run is refused before any rank starts, naming the latest checkpoint there
    overwrite: bool = False
    # save in the background: the save step copies the state to host memory (about the size of the
    # rank's checkpoint files) and training goes on while a thread writes, fsyncs and fingerprints
    # them; `latest` moves once every rank's files are durable. The next save, a stop and the end
    # of training wait for it (docs/checkpoints.md, "Asynchronous saves")
    async_save: bool = False

    def problems(self) -> list[str]:
        p: list[str] = []
        for name in ("save_interval", "keep_last"):
            non_negative(p, f"checkpoint.{name}", getattr(self, name))
        if self.new_phase and not self.init_from:
            p.append("checkpoint.new_phase needs checkpoint.init_from (the previous phase's checkpoint)")
        if self.init_tiled:
            if not self.init_from:
                p.append("checkpoint.init_tiled needs checkpoint.init_from (the smaller ModernBERT to tile)")
            for key in ("init_optimizer_states", "new_phase"):
                if getattr(self, key):
                    p.append(f"checkpoint.init_tiled takes the weights only: the smaller model's optimizer state "
                             f"does not fit the larger one; remove checkpoint.{key}")
        return p

    @property
    def loads_optimizer_states(self) -> bool:
        """Whether init_from's optimizer states are loaded (init_optimizer_states, or a new phase)."""
        return self.init_optimizer_states or self.new_phase


# Keys that lived in `train` before this section existed: a config naming one is refused with its new
# place (no silent alias); checkpoints written before keep loading (Config.from_stored moves them).
MOVED_KEYS: dict[str, str] = {f"train.{key}": f"checkpoint.{key}" for key in (
    "save_dir", "load_dir", "save_interval", "keep_last", "init_from", "init_optimizer_states", "accept_new_vocab")}
