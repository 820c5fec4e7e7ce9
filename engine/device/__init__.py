"""Device execution: one `SchedulerOutput` run on the GPU (or the CPU): the model runner, its
batch inputs, the paged KV cache, attention, CUDA graphs, sampling and the weights."""
