# flowlane: two commands for a fresh machine (python3, gcc, make).
#   make train   the main job: default recipe (installs the llm lane on first use)
#   make test    every test: both lanes + the NCCL net plugin (installs both lanes on first use)
#   make test-fast  the framework-free core (Hermod's model, the simulator): the edit loop
.PHONY: train test test-fast lanes plugin lint clean

train:
	scripts/train.sh $(ARGS)

test:
	scripts/test.sh $(ARGS)

# the edit loop: Hermod's pure model and the simulator, no framework, no multi-rank runs (a few minutes)
test-fast:
	scripts/bootstrap.sh llm
	.venv-llm/bin/python -m pytest -q -p no:cacheprovider -m "once and not slow" $(ARGS)

lanes:
	scripts/bootstrap.sh llm
	scripts/bootstrap.sh gnn

plugin:
	$(MAKE) -C nccl_net_plugin

lint: lanes
	.venv-llm/bin/ruff check flowlane megatron_plugin deepspeed_plugin dgl_plugin recipes benchmarks tests

clean:
	rm -rf .venv-llm .venv-gnn .tools results/train results/test-reports outputs  # results/ itself is tracked
	[ ! -f nccl_net_plugin/Makefile ] || $(MAKE) -C nccl_net_plugin clean
