"""Classification defaults, in a module light enough for the CLI to import at start-up."""

import math

LOCAL_MIN_DIAGONAL = 0.8  # 80% of the mass within +-2 tokens of the query
COPY_MAX_ENTROPY = math.log(2)  # no more spread than an even split over two tokens
BROAD_MIN_ENTROPY_NORM = 0.7  # at least 70% of the maximum ln(k) for the row
SINK_MIN_FIRST_TOKEN = 0.5  # extended: most of a copy head's mass on the first token
PREVIOUS_MIN_PREVIOUS_TOKEN = 0.5  # extended: most of a local head's mass on token i - 1
DORMANT_MAX_OUTPUT_RATIO = 0.5  # extended: a sink writing less than half its layer's median output_norm
STREAMING_MIN_SINK_WINDOW = 0.95  # kv: almost all of a head's mass on the sinks plus the recent window

# analyze
SINK_TOKENS = 4  # sink_window: the first S keys (the attention sinks of StreamingLLM)
WINDOW = 256  # sink_window: the W most recent keys, j > i - W
BLOCK_MIB = 64  # blocked attention: memory for one block of query rows (small blocks stay in cache)
FEW_SENTENCES = 10  # below this many sentences, a bootstrap over sentences gives intervals that mean little

# train-pattern: DuoAttention's (mit-han-lab/duo-attention fe93c31; trainpattern.py's docstring names each source)
DUO_LR = 0.02  # scripts/run_train.sh, and every published pattern's config.json
DUO_REG_WEIGHT = 0.05  # scripts/run_train.sh
DUO_SINK = 128  # scripts/train.sh --sink_size
DUO_RECENT = 256  # scripts/train.sh --recent_size
DUO_SEED = 42  # duo_attn/utils.py --seed
DUO_STEPS = 2000  # scripts/train.sh --num_steps
DUO_PASSKEYS = 10  # scripts/run_train.sh num_passkey
DUO_PASSKEY_WORDS = 32  # duo_attn/data.py passkey_length
# and attnprobe's own, smaller: the default run on SmolLM2-135M fits 20 minutes on two CPU cores (docs/kv-cache.md)
TRAIN_LENGTHS = (1024, 1280)  # tokens per sample (DuoAttention: 1,000 to 32,000 haystack tokens)
TRAIN_STEPS = 60
TRAIN_PASSKEYS = 3
TRAIN_PASSKEY_WORDS = 8
TRAIN_CHECKPOINT_EVERY = 10  # steps (DuoAttention saves every 50)

# compose
COMPOSE_SAMPLES = 200  # pairs of random matrices for the composition baseline
COMPOSE_SEED = 0
COMPOSE_TOP = 30  # the strongest edges per mode composition.png draws

# export --format layer-budgets
BUDGET_RATIO = 0.5  # the overall compression ratio (kvpress's: the fraction of KV entries removed)
BUDGET_MIN_KEPT = 0.1  # no layer keeps less than a tenth of its entries
