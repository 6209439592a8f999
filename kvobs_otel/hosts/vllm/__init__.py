"""Stock vLLM (and vllm-ascend, which subclasses it): seams on the
OffloadingConnector facade, its worker, and the OffloadingWorker it builds."""
