"""Config-driven pretraining: the top layer of the library.

Grouped by concern: `config/` (PretrainConfig, YAML loading and validation), `data/` (preparation, sources,
blends, batches), `run/` (the run directory, its lock, resume, the summary, stop signals), `guards/` (rank
agreement, replica audit, divergence); beside them the step: the optimizer (`optim`, its state sharded across
data-parallel ranks by `sharded_optimizer`), the data-parallel gradient reduction (`data_parallel`, `fsdp`), the
global norm (`gradients`), precision and loss scaling, metrics, and the loop itself (`trainer`). May import every
other sub-package; nothing imports it but the scripts (and the top-level package, for `PretrainConfig` and
`load_config`).
"""

from .config.schema import (CheckpointConfig, ConfigError, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig,
                            ParallelConfig, PretrainConfig, ScheduleConfig, TrainingConfig, config_from_dict,
                            load_config, save_config)
from .data.prepare.corpus import Corpus, CorpusStats
from .data.read.batches import GlobalBatchSampler
from .data.read.validation import validation_batches
from .data.prepare.run_data_dir import ensure_prepared, prepare_data, read_meta
from .data_parallel import wrap_data_parallel
from .gradients import all_reduce_data_parallel, clip_gradients, global_grad_norm
from .optim import build_optimizer, learning_rate
from .sharded_optimizer import optimizer_state_bytes
from .data.prepare.bpe import train_bpe
from .tokenizer import ByteTokenizer, HFTokenizer, TokenizerUnavailableError, get_tokenizer, tokenizer_vocab_size
from .trainer import TrainResult, train
