import torch
import torch.nn as nn
import triton
import triton.language as tl

# Triton grouped GEMM kernel with fused SwiGLU, Block Swizzling, and Direct Lookup
@triton.autotune(
    configs=[
        # 128x128 block configs
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 128, 'BLOCK_K': 64, 'num_warps': 8, 'num_stages': 3}),
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 128, 'BLOCK_K': 64, 'num_warps': 8, 'num_stages': 4}),
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 128, 'BLOCK_K': 64, 'num_warps': 8, 'num_stages': 5}),
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 8, 'num_stages': 3}),
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 8, 'num_stages': 4}),
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 128, 'BLOCK_K': 32, 'num_warps': 8, 'num_stages': 4}),
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 128, 'BLOCK_K': 32, 'num_warps': 8, 'num_stages': 5}),
        
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 128, 'BLOCK_K': 64, 'num_warps': 4, 'num_stages': 3}),
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 128, 'BLOCK_K': 64, 'num_warps': 4, 'num_stages': 4}),
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 128, 'BLOCK_K': 32, 'num_warps': 4, 'num_stages': 4}),
        
        # 128x256 block configs
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 256, 'BLOCK_K': 64, 'num_warps': 8, 'num_stages': 3}),
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 256, 'BLOCK_K': 64, 'num_warps': 8, 'num_stages': 4}),
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 256, 'BLOCK_K': 32, 'num_warps': 8, 'num_stages': 4}),
        
        # 128x64 block configs
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 64, 'BLOCK_K': 64, 'num_warps': 4, 'num_stages': 3}),
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 64, 'BLOCK_K': 64, 'num_warps': 4, 'num_stages': 4}),
        triton.Config({'BLOCK_M': 128, 'BLOCK_N': 64, 'BLOCK_K': 32, 'num_warps': 4, 'num_stages': 4}),
    ],
    key=['I', 'H']
)
@triton.jit
def _grouped_gemm_swiglu_kernel(
    # Input pointers
    A_ptr, W_gate_ptr, W_up_ptr, C_ptr,
    expert_offsets_ptr, start_tile_m_idx_ptr,
    block_to_expert_ptr,
    # Dimensions
    H, I, E,
    # Strides
    stride_A_m, stride_A_k,
    stride_W_e, stride_W_k, stride_W_n,
    stride_C_m, stride_C_n,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Determine the block coordinate
    block_id = tl.program_id(0)
    tiles_n = tl.cdiv(I, BLOCK_N)
    
    block_m_idx_pre = block_id // tiles_n
    
    # Direct lookup of expert e from precalculated GPU array!
    e = tl.load(block_to_expert_ptr + block_m_idx_pre)
            
    # Retrieve the starting tile M index and count of expert e
    start_tile_m = tl.load(start_tile_m_idx_ptr + e)
    next_start_tile_m = tl.load(start_tile_m_idx_ptr + e + 1)
    M_tiles = next_start_tile_m - start_tile_m
    
    # Compute local block ID within expert e
    local_block_id = block_id - start_tile_m * tiles_n
    
    # Apply L2 swizzling (block grouping) to the local blocks within expert e
    GROUP_M = 8
    group_id = local_block_id // (GROUP_M * tiles_n)
    first_tile_m = group_id * GROUP_M
    group_size_m = min(M_tiles - first_tile_m, GROUP_M)
    
    tile_m = first_tile_m + ((local_block_id % (GROUP_M * tiles_n)) % group_size_m)
    tile_n = (local_block_id % (GROUP_M * tiles_n)) // group_size_m
    
    # Offsets in token space
    offset_A_e = tl.load(expert_offsets_ptr + e)
    offset_C_e = offset_A_e
    
    # Expert size
    next_offset = tl.load(expert_offsets_ptr + e + 1)
    M_e = next_offset - offset_A_e
    
    # If the block is somehow out of range (should not happen with correct block count)
    if tile_m * BLOCK_M >= M_e:
        return
        
    # Pointers to A, W_gate, W_up
    a_base = A_ptr + (offset_A_e + tile_m * BLOCK_M) * stride_A_m
    w_gate_base = W_gate_ptr + e * stride_W_e + tile_n * BLOCK_N * stride_W_n
    w_up_base = W_up_ptr + e * stride_W_e + tile_n * BLOCK_N * stride_W_n
    
    # Coordinate grids
    a_offs_m = tl.arange(0, BLOCK_M)[:, None]
    a_offs_k = tl.arange(0, BLOCK_K)[None, :]
    w_offs_k = tl.arange(0, BLOCK_K)[:, None]
    w_offs_n = tl.arange(0, BLOCK_N)[None, :]
    
    # M-mask is constant across all K loop iterations
    a_mask = (tile_m * BLOCK_M + a_offs_m < M_e)
    
    # Initialize pointers
    a_ptr = a_base + a_offs_m * stride_A_m + a_offs_k * stride_A_k
    w_gate_ptr = w_gate_base + w_offs_k * stride_W_k + w_offs_n * stride_W_n
    w_up_ptr = w_up_base + w_offs_k * stride_W_k + w_offs_n * stride_W_n
    
    # Initialize accumulators
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    
    # Matrix multiplication loop over K
    for k in range(0, H, BLOCK_K):
        # Load A and weights
        a_tile = tl.load(a_ptr, mask=a_mask, other=0.0)
        w_gate_tile = tl.load(w_gate_ptr)
        w_up_tile = tl.load(w_up_ptr)
        
        # Perform dot product
        acc_gate += tl.dot(a_tile, w_gate_tile)
        acc_up += tl.dot(a_tile, w_up_tile)
        
        # Increment pointers for next K iteration
        a_ptr += BLOCK_K * stride_A_k
        w_gate_ptr += BLOCK_K * stride_W_k
        w_up_ptr += BLOCK_K * stride_W_k
        
    # Elementwise SwiGLU: silu(gate) * up
    # silu(x) = x * sigmoid(x) = x / (1 + exp(-x))
    # We do calculation in fp32 for precision
    silu_gate = acc_gate / (1.0 + tl.exp(-acc_gate))
    out = silu_gate * acc_up
    
    # Store result
    c_base = C_ptr + (offset_C_e + tile_m * BLOCK_M) * stride_C_m + tile_n * BLOCK_N * stride_C_n
    c_offs_m = tl.arange(0, BLOCK_M)[:, None]
    c_offs_n = tl.arange(0, BLOCK_N)[None, :]
    c_mask = (tile_m * BLOCK_M + c_offs_m < M_e) & (tile_n * BLOCK_N + c_offs_n < I)
    
    tl.store(c_base + c_offs_m * stride_C_m + c_offs_n * stride_C_n, out.to(tl.bfloat16), mask=c_mask)


class Model(nn.Module):
    """Up-projection of a top-K MoE FFN with fused SwiGLU.

    Inputs at call time:
      hidden_states:    (T_perm, H)  bf16, already permuted to expert order
      expert_offsets:   (E+1,)       int32, prefix sums of token counts per expert
                                     so expert e owns rows [offsets[e]:offsets[e+1]]
                                     T_perm = T_total * K (each token visits K experts)

    Output:
      gated_up:         (T_perm, I)  bf16
    """

    def __init__(self, T_total: int, H: int, I: int, E: int, K: int):
        super().__init__()
        self.T_total = T_total
        self.H = H
        self.I = I
        self.E = E
        self.K = K
        # Two weight tensors per expert: gate (E, H, I) and up (E, H, I).
        self.W_gate = nn.Parameter(torch.empty(E, H, I, dtype=torch.bfloat16))
        self.W_up = nn.Parameter(torch.empty(E, H, I, dtype=torch.bfloat16))
        nn.init.normal_(self.W_gate, std=0.02)
        nn.init.normal_(self.W_up, std=0.02)

    def forward(
        self,
        hidden_states: torch.Tensor,   # (T_perm, H) bf16
        expert_offsets: torch.Tensor,  # (E+1,) int32
    ) -> torch.Tensor:
        T_perm, H = hidden_states.shape
        device = hidden_states.device
        
        # Output tensor
        out = torch.empty(T_perm, self.I, dtype=torch.bfloat16, device=device)
        
        # Compute block metadata on the GPU using PyTorch to launch the grid
        expert_sizes = expert_offsets[1:] - expert_offsets[:-1]
        
        # BLOCK_M is fixed to 128
        BLOCK_M = 128
        
        tiles_m = torch.clamp((expert_sizes + BLOCK_M - 1) // BLOCK_M, min=0)
        
        # Build start_tile_m_idx on GPU
        start_tile_m_idx = torch.zeros(self.E + 1, dtype=torch.int32, device=device)
        torch.cumsum(tiles_m, dim=0, out=start_tile_m_idx[1:])
        
        total_tiles_m = start_tile_m_idx[-1].item()
        
        # If total_tiles_m is 0 (i.e. no tokens), we can just return the empty tensor
        if total_tiles_m == 0:
            return out
            
        # Precompute block-to-expert and block-to-tile_m mapping on GPU
        block_to_expert = torch.repeat_interleave(
            torch.arange(self.E, dtype=torch.int32, device=device),
            tiles_m
        )
            
        # Grid function that gets BLOCK_N dynamically from the Triton Config
        def grid_fn(meta):
            BLOCK_N = meta['BLOCK_N']
            tiles_n = (self.I + BLOCK_N - 1) // BLOCK_N
            return (total_tiles_m * tiles_n,)
        
        _grouped_gemm_swiglu_kernel[grid_fn](
            hidden_states, self.W_gate, self.W_up, out,
            expert_offsets, start_tile_m_idx, block_to_expert,
            H, self.I, self.E,
            hidden_states.stride(0), hidden_states.stride(1),
            self.W_gate.stride(0), self.W_gate.stride(1), self.W_gate.stride(2),
            out.stride(0), out.stride(1),
        )
        
        return out


# Module-level shape shims rewritten by check.py / benchmark.py per shape.
T_total = 32768
H = 4096
I = 1536
E = 128
K = 8


def _build_routing(T_total: int, E: int, K: int, device: str = "cpu") -> torch.Tensor:
    """Round-robin-ish routing metadata: balanced offsets summing to T_total*K."""
    T_perm = T_total * K
    # Even split with remainder distributed to first experts.
    base = T_perm // E
    rem = T_perm - base * E
    counts = torch.full((E,), base, dtype=torch.int32, device=device)
    counts[:rem] += 1
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=device)
    offsets[1:] = torch.cumsum(counts, dim=0)
    return offsets


def get_inputs():
    T_perm = T_total * K
    hidden_states = torch.randn(T_perm, H, dtype=torch.bfloat16) * 0.1
    expert_offsets = _build_routing(T_total, E, K)
    return [hidden_states, expert_offsets]


def get_init_inputs():
    return [T_total, H, I, E, K]
