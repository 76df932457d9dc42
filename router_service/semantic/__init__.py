"""Local semantic routing (seed 004): jieba and a domain lexicon turn text into features,
sparse TF-IDF over every module's examples finds the closest module, and conservative gates
decide whether that module may run without asking the model.

```python
config = load_semantic_config("system-semantic.json")
router = SemanticRouter(profiles, config)          # builds the index once
decision = router.decide("打开商城", "zh", allowed={"system:shop"})
if decision.outcome == "direct":
    run(decision.module_id, decision.input)
```

Modules, one job each: `config` (system-semantic.json), `text` (normalisation and features,
`lexicon.json`), `profiles` (routing profiles and their JSON loader), `index` (TF-IDF matching),
`guards` (negation, condition, reference, compound, write), `extractors` (arguments from this
text), `ngram` (the word and character n-gram scorer, thresholds from the catalogue), `router`
(the gates and the decision). None imports gRPC.
"""

from router_service.semantic.config import (
    Mode,
    SemanticConfig,
    Threshold,
    ensure_semantic_config,
    load_semantic_config,
    parse_semantic_config,
    reload_changes,
)
from router_service.semantic.extractors import EXTRACTORS, extract
from router_service.semantic.guards import (
    GUARDS,
    Guard,
    check_guards,
    declared_markers,
    fired_guards,
)
from router_service.semantic.index import Match, ModuleScore, SemanticIndex
from router_service.semantic.ngram import NgramScorer
from router_service.semantic.profiles import Profile, load_profiles, parse_profiles
from router_service.semantic.router import (
    ALGORITHM,
    FallbackCandidate,
    LocalDecision,
    Outcome,
    SemanticRouter,
)
from router_service.semantic.text import (
    ITEM,
    NUM,
    Analysis,
    Analyzer,
    Lexicon,
    clean,
    detect_language,
    normalize,
)

__all__ = [
    "ALGORITHM",
    "EXTRACTORS",
    "GUARDS",
    "ITEM",
    "NUM",
    "Analysis",
    "Analyzer",
    "FallbackCandidate",
    "Guard",
    "Lexicon",
    "LocalDecision",
    "Match",
    "Mode",
    "ModuleScore",
    "NgramScorer",
    "Outcome",
    "Profile",
    "SemanticConfig",
    "SemanticIndex",
    "SemanticRouter",
    "Threshold",
    "check_guards",
    "clean",
    "declared_markers",
    "detect_language",
    "extract",
    "fired_guards",
    "load_profiles",
    "ensure_semantic_config",
    "load_semantic_config",
    "normalize",
    "parse_profiles",
    "parse_semantic_config",
    "reload_changes",
]
