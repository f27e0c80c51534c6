/* GQA attention with eight-float vectors: attention_body.h under an AVX2 target (no FMA:
 * the bits must equal the portable four-lane build, which has none). */
#pragma GCC target("avx2")

#define VW 8
#define ATTEND_ONE colibri_attend_one_avx2
#include "../attention_body.h"
