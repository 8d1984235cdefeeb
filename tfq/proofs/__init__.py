"""The proofs: start-up guards (startup, startup_kernels), the kernel check (kernel_check), the together check
(together). Each proves one part of the exactness rule on the running build."""
