"""Config-driven pretraining: the top layer of the library.

Owns the run config (`config`: PretrainConfig, YAML loading and validation), data and
tokenizers, the optimizer (its state sharded across data-parallel ranks: `sharded_optimizer`) and
schedule, the data-parallel gradient reduction (`data_parallel`), the global norm (`gradients`), loss
scaling, metrics, where a run resumes from (`resume`), and the loop itself (`trainer`). May import
every other sub-package; nothing imports it but the scripts
(and the top-level package, for `PretrainConfig` and `load_config`).
"""

from .config import (CheckpointConfig, ConfigError, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig,
                     ParallelConfig, PretrainConfig, ScheduleConfig, TrainingConfig, config_from_dict, load_config,
                     save_config)
from .corpus import Corpus, CorpusStats
from .batches import GlobalBatchSampler, validation_batches
from .data import ensure_prepared, prepare_data, read_meta
from .data_parallel import wrap_data_parallel
from .gradients import all_reduce_data_parallel, clip_gradients, global_grad_norm
from .optim import build_optimizer, learning_rate
from .sharded_optimizer import optimizer_state_bytes
from .tokenizer import (ByteTokenizer, HFTokenizer, TokenizerUnavailableError, get_tokenizer, tokenizer_vocab_size,
                        train_bpe)
from .trainer import TrainResult, train
