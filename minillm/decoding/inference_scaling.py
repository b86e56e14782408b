"""Inference-time scaling (test-time compute): sample N candidates, then pick one (chapter 01).

A model that is sometimes right can be made right more often by sampling several answers and
choosing among them. How much that helps depends on what does the choosing:

* a verifier that checks an answer (unit tests, a proof checker, a known result): any correct
  candidate is found, so success is pass@N, the chance that at least one of N is correct;
* a weaker, rule-based verifier that rejects some wrong answers without knowing the right one;
* the model's own confidence, e.g. the candidate with the highest mean token log-probability;
* self-consistency (Wang et al., 2022): the answer most candidates agree on, a majority vote.

The last two only find what the model already believes most; as N grows they converge on the
mode of its distribution, while a verifier keeps gaining from every new candidate.

The task, for the shipped shakespeare-11m: **who speaks next?** The prompt is four turns of a
scene in the plays' format (a speaker line "NAME." then the speech); the model continues with
"\\nNAME.\\n", and the answer is the character who really speaks next. `success_curve` measures
the four ways of choosing over `NEXT_SPEAKER_EXCERPTS` for N = 1 ... 32. The excerpts are from the
plays the model was trained on: a model this small does not pick up the names of characters it
has never seen from the context, and on the held-out plays it names the right speaker in about 1%
of samples. So this measures what the model remembers of the plays and their scenes.
"""

from __future__ import annotations

import random
import re
import statistics
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from minillm.decoding.generation import GenerationOutput
from minillm.decoding.parallel_sampling import CompletionOutput, generate_n
from minillm.model import Transformer
from minillm.sampler.sampling import SamplingParams
from minillm.tokenizer import Tokenizer

Candidate = TypeVar("Candidate")
Answer = TypeVar("Answer", bound=Hashable)


# ------------------------------------------------------------------ choosing among candidates
def mean_logprob(candidate: GenerationOutput) -> float:
    """A candidate's mean token log-probability, the model's confidence in it (chapter 01).

    The mean, not the sum, so that longer candidates are not penalised for their length.
    """
    if not candidate.logprobs:
        raise ValueError(
            "mean_logprob needs per-token log-probabilities: generate with SamplingParams(logprobs=0), "
            "or use generate_n, which always reports them."
        )
    return statistics.fmean(candidate.logprobs)


def best_of_n(candidates: Sequence[Candidate], scorer: Callable[[Candidate], Any]) -> Candidate:
    """The candidate with the highest `scorer(candidate)`; the first of them on ties (chapter 01).

    `scorer` may return a number (e.g. `mean_logprob`), a bool (a verifier: the first candidate
    that passes, or the first candidate if none does), or a tuple compared in order, e.g.
    `lambda c: (verifier(c), mean_logprob(c))`: the most confident of the candidates that pass.
    """
    if not candidates:
        raise ValueError("best_of_n needs at least one candidate.")
    scores = [scorer(c) for c in candidates]
    best = max(range(len(candidates)), key=lambda i: scores[i])  # max keeps the first maximum
    return candidates[best]


def self_consistency(answers: Sequence[Answer | None]) -> tuple[Answer | None, float]:
    """Majority vote: the most common answer and its share of all answers (chapter 01).

    None means the candidate gave no answer (it could not be parsed): it does not vote, but it
    counts in the share's denominator. Ties go to the answer that occurs first. All None gives
    (None, 0.0).

    Example:
        >>> self_consistency(["IAGO", "CASSIO", None, "CASSIO", "IAGO"])
        ('IAGO', 0.4)
    """
    if not answers:
        raise ValueError("self_consistency needs at least one answer.")
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None, 0.0
    winner = max(votes, key=lambda a: votes[a])  # Counter keeps first-occurrence order; max keeps the first
    return winner, votes[winner] / len(answers)


# ------------------------------------------------------------------ the task: who speaks next?
SPEAKER_LINE = re.compile(r"[A-Z][A-Z' ]*[A-Z]")  # "OTHELLO", "FIRST CITIZEN", "DROMIO OF EPHESUS"
STOP = ".\n"  # a speaker line ends "NAME.\n"


@dataclass(frozen=True)
class Excerpt:
    """Four consecutive turns of a scene and the character who speaks next.

    `prompt` ends right after the last speech's last line (with its newline); the play goes on
    with "\\n" + speaker + ".\\n".
    """

    prompt: str
    speaker: str

    @property
    def speakers(self) -> list[str]:
        """The speakers of the excerpt's turns, in order."""
        return [turn.split("\n", 1)[0].removesuffix(".") for turn in self.prompt.split("\n\n")]


def parse_speaker(candidate: GenerationOutput) -> str | None:
    """The name a candidate gave, or None if its text is not a speaker line "\\nNAME" ending at the stop ".\\n"."""
    text = candidate.text or ""
    match = SPEAKER_LINE.fullmatch(text.removeprefix("\n"))
    return match.group(0) if match and candidate.finish_reason == "stop" else None


def is_plausible(excerpt: Excerpt, candidate: GenerationOutput) -> bool:
    """A rule-based verifier that does not know the answer: the name is one of the excerpt's
    speakers, and not the one who has just spoken (a character rarely answers themself)."""
    name = parse_speaker(candidate)
    return name in excerpt.speakers and name != excerpt.speakers[-1]


def sample_candidates(
    model: Transformer, tokenizer: Tokenizer, excerpt: Excerpt, num: int, seed: int = 0, temperature: float = 1.0
) -> list[CompletionOutput]:
    """`num` sampled continuations of the excerpt up to the end of a speaker line, in seed order.

    One `generate_n` batch: candidate i is sampled with seed + i.
    """
    params = SamplingParams(temperature=temperature, max_tokens=12, stop=[STOP], n=num, seed=seed)
    return sorted(generate_n(model, excerpt.prompt, params, tokenizer), key=lambda c: c.index)


METHODS = ("pass@N", "rule verifier", "mean logprob", "majority vote")


def _successes(excerpt: Excerpt, group: Sequence[CompletionOutput]) -> dict[str, bool]:
    """Whether each way of choosing among one group of candidates gets the next speaker right."""
    def right(candidate: CompletionOutput) -> bool:
        return parse_speaker(candidate) == excerpt.speaker

    return {
        "pass@N": any(right(c) for c in group),  # a verifier that knows the answer
        "rule verifier": right(best_of_n(group, lambda c: (is_plausible(excerpt, c), mean_logprob(c)))),
        "mean logprob": right(best_of_n(group, mean_logprob)),
        "majority vote": self_consistency([parse_speaker(c) for c in group])[0] == excerpt.speaker,
    }


def success_curve(
    model: Transformer,
    tokenizer: Tokenizer,
    excerpts: Sequence[Excerpt] | None = None,
    ns: Sequence[int] = (1, 2, 4, 8, 16, 32),
    pool: int = 64,
    seed: int = 0,
    temperature: float = 1.0,
) -> dict[str, dict[int, float]]:
    """Success rate of each way of choosing, for each number of candidates N (chapter 01).

    For every excerpt, `pool` candidates are sampled in one batch (seeds seed ... seed + pool - 1)
    and cut into pool // N disjoint groups of N; a method's success rate at N is the fraction of
    (excerpt, group) pairs where its choice names the right speaker (pass@N: where any candidate
    does). Deterministic: the same arguments give the same numbers.

    Args:
        model, tokenizer: shakespeare-11m (`minillm.load(minillm.DEFAULT_MODEL)`) or another model.
        excerpts: the task; default `NEXT_SPEAKER_EXCERPTS`.
        ns: the group sizes N, each at most `pool`.
        pool: candidates sampled per excerpt.
        seed: the first seed.
        temperature: the sampling temperature.
    Returns:
        {method: {N: success rate}} for the methods in `METHODS`.
    """
    excerpts = NEXT_SPEAKER_EXCERPTS if excerpts is None else excerpts
    if any(not 1 <= n <= pool for n in ns):
        raise ValueError(f"every N must be in [1, pool] = [1, {pool}], got ns={list(ns)}.")
    hits: dict[str, dict[int, list[bool]]] = {m: {n: [] for n in ns} for m in METHODS}
    for excerpt in excerpts:
        candidates = sample_candidates(model, tokenizer, excerpt, pool, seed, temperature)
        for n in ns:
            for start in range(0, pool - n + 1, n):
                for method, ok in _successes(excerpt, candidates[start : start + n]).items():
                    hits[method][n].append(ok)
    return {m: {n: statistics.fmean(hits[m][n]) for n in ns} for m in METHODS}


def format_curve(curve: dict[str, dict[int, float]]) -> str:
    """The curve as a text table: one row per method, one column per N."""
    ns = list(next(iter(curve.values())))
    lines = [f"{'N':>14} " + " ".join(f"{n:>6}" for n in ns)]
    lines += [f"{m:>14} " + " ".join(f"{curve[m][n]:6.3f}" for n in ns) for m in curve]
    return "\n".join(lines)


# ------------------------------------------------------------------ where the excerpts come from
def find_excerpts(corpus: str, count: int = 40, seed: int = 0, turns: int = 4, max_chars: int = 360) -> list[Excerpt]:
    """Draw `count` next-speaker excerpts from a corpus in the plays' format (how the shipped ones were made).

    A candidate position is a speaker turn preceded, in the same scene, by `turns` speaker turns
    (no stage direction between them) that fit in `max_chars` characters, among which at least
    three characters speak, including the next speaker, who is not the last one to speak.
    `NEXT_SPEAKER_EXCERPTS` is `find_excerpts(train.txt)` on the training split of `minillm.train.corpus`.
    """
    head = re.compile(rf"({SPEAKER_LINE.pattern})\.\n(.+)", flags=re.S)
    candidates = []
    scene: list[tuple[str, str] | None] = []  # (speaker, speech) per paragraph, None for anything else
    for paragraph in corpus.split("\n\n"):
        paragraph = paragraph.strip("\n")
        if paragraph.startswith(("ACT ", "SCENE")):
            scene = []
            continue
        turn = head.fullmatch(paragraph)
        scene.append((turn.group(1), turn.group(2)) if turn else None)
        context = scene[-turns - 1 : -1]
        if turn is None or len(context) < turns or None in context:
            continue
        names = [name for name, _ in context]
        prompt = "\n\n".join(f"{name}.\n{speech}" for name, speech in context) + "\n"
        speaker = turn.group(1)
        if len(prompt) <= max_chars and len(set(names)) >= 3 and speaker in names and speaker != names[-1]:
            candidates.append(Excerpt(prompt, speaker))
    return random.Random(seed).sample(candidates, count)


def _read_excerpts(text: str) -> tuple[Excerpt, ...]:
    """Excerpts written one after the other, each ending in a line "-> SPEAKER", separated by lines "~~~"."""
    excerpts = []
    for block in text.strip("\n").split("\n~~~\n"):
        prompt, speaker = block.rsplit("\n-> ", 1)
        excerpts.append(Excerpt(prompt + "\n", speaker))
    return tuple(excerpts)


# find_excerpts(train.txt, count=40, seed=0): Gutenberg's public-domain text of the plays.
NEXT_SPEAKER_EXCERPTS: tuple[Excerpt, ...] = _read_excerpts("""
POET.
When we for recompense have prais'd the vile,
It stains the glory in that happy verse
Which aptly sings the good.

MERCHANT.
[Looking at the jewel.]
'Tis a good form.

JEWELLER.
And rich: here is a water, look ye.

PAINTER.
You are rapt, sir, in some work, some dedication
To the great lord.
-> POET
~~~
AJAX.
O thou damned cur! I shall--

ACHILLES.
Will you set your wit to a fool's?

THERSITES.
No, I warrant you, the fool's will shame it.

PATROCLUS.
Good words, Thersites.
-> ACHILLES
~~~
FIRST SOLDIER.
Let's hear him, for the things he speaks
May concern Caesar.

THIRD SOLDIER.
Let's do so. But he sleeps.

FIRST SOLDIER.
Swoons rather; for so bad a prayer as his
Was never yet fore sleep.

SECOND SOLDIER.
Go we to him.
-> THIRD SOLDIER
~~~
MACDUFF.
My ever-gentle cousin, welcome hither.

MALCOLM.
I know him now. Good God, betimes remove
The means that makes us strangers!

ROSS.
Sir, amen.

MACDUFF.
Stands Scotland where it did?
-> ROSS
~~~
VALENTINE.
Leave off discourse of disability;
Sweet lady, entertain him for your servant.

PROTEUS.
My duty will I boast of, nothing else.

SILVIA.
And duty never yet did want his meed.
Servant, you are welcome to a worthless mistress.

PROTEUS.
I'll die on him that says so but yourself.
-> SILVIA
~~~
THIRD LORD.
Did you see my cap?

SECOND LORD.
Here 'tis.

FOURTH LORD.
Here lies my gown.

FIRST LORD.
Let's make no stay.
-> SECOND LORD
~~~
PAGE.
Let's go in, gentlemen; but, trust me, we'll mock him. I do invite
you to-morrow morning to my house to breakfast; after, we'll
a-birding together; I have a fine hawk for the bush. Shall it be so?

FORD.
Any thing.

EVANS.
If there is one, I shall make two in the company.

CAIUS.
If there be one or two, I shall make-a the turd.
-> FORD
~~~
SIR ANDREW.
Marry, will I, sir; and for that I promised you, I'll be
as good as my word. He will bear you easily and reins well.

FIRST OFFICER.
This is the man; do thy office.

SECOND OFFICER.
Antonio, I arrest thee at the suit
Of Count Orsino.

ANTONIO.
You do mistake me, sir.
-> FIRST OFFICER
~~~
PRINCE.
Ay brother,--to our grief, as it is yours:
Too late he died that might have kept that title,
Which by his death hath lost much majesty.

GLOSTER.
How fares our cousin, noble Lord of York?

YORK.
I thank you, gentle uncle. O, my lord,
You said that idle weeds are fast in growth:
The prince my brother hath outgrown me far.

GLOSTER.
He hath, my lord.
-> YORK
~~~
KING.
Madam, I will, if suddenly I may.

PRINCESS.
You will the sooner that I were away,
For you'll prove perjur'd if you make me stay.

BEROWNE.
Did not I dance with you in Brabant once?

ROSALINE.
Did not I dance with you in Brabant once?
-> BEROWNE
~~~
FLORIZEL.
He shall not.

POLIXENES.
              Pr'ythee let him.

FLORIZEL.
                                No, he must not.

SHEPHERD.
Let him, my son: he shall not need to grieve
At knowing of thy choice.
-> FLORIZEL
~~~
BURGUNDY.
Traitors have never other company.
But what 's that Pucelle whom they term so pure?

TALBOT.
A maid, they say.

BEDFORD.
A maid! and be so martial!

BURGUNDY.
Pray God she prove not masculine ere long,
If underneath the standard of the French
She carry armour as she hath begun.
-> TALBOT
~~~
ESCALUS.
In very good time:--speak not you to him till we call upon you.

LUCIO.
Mum.

ESCALUS.
Come, sir: did you set these women on to slander Lord Angelo?
they have confessed you did.

DUKE.
'Tis false.
-> ESCALUS
~~~
BEDFORD.
Ascend, brave Talbot; we will follow thee.

TALBOT.
Not all together:  better far, I guess,
That we do make our entrance several ways;
That, if it chance the one of us do fail,
The other yet may rise against their force.

BEDFORD.
Agreed:  I 'll to yond corner.

BURGUNDY.
And I to this.
-> TALBOT
~~~
BARD.
Indeed, Sir John, you said so.

FAL.
Yea, if he said my ring was copper.

PRINCE.
I say 'tis copper:  darest thou be as good as thy word now?

FAL.
Why, Hal, thou know'st, as thou art but man, I dare; but as thou
art prince, I fear thee as I fear the roaring of the lion's whelp.
-> PRINCE
~~~
DUMAINE.
[Aside to BOYET.] He may not by the yard.

ARMADO.
'This Hector far surmounted Hannibal,'--

COSTARD.
The party is gone; fellow Hector, she is gone; she is two
months on her way.

ARMADO.
What meanest thou?
-> COSTARD
~~~
CARDINAL.
[Aside to Gloster.] Ay, where thou dar'st not peep;
an if thou dar'st,
This evening, on the east side of the grove.

KING.
How now, my lords!

CARDINAL.
Believe me, cousin Gloster,
Had not your man put up the fowl so suddenly,
We had had more sport.--[Aside to Gloster.] Come with thy
two-hand sword.

GLOSTER.
True, uncle.
-> CARDINAL
~~~
BRABANTIO.
What is the reason of this terrible summons?
What is the matter there?

RODERIGO.
Signior, is all your family within?

IAGO.
Are your doors locked?

BRABANTIO.
Why, wherefore ask you this?
-> IAGO
~~~
FALSTAFF.
Wait close; I will not see him.

CHIEF JUSTICE.
What's he that goes there?

SERVANT.
Falstaff, an 't please your lordship.

CHIEF JUSTICE.
He that was in question for the robbery?
-> SERVANT
~~~
ADRIANA.
Which of you two did dine with me to-day?

ANTIPHOLUS OF SYRACUSE.
I, gentle mistress.

ADRIANA.
And are not you my husband?

ANTIPHOLUS OF EPHESUS.
No; I say nay to that.
-> ANTIPHOLUS OF SYRACUSE
~~~
CASSIO.
No.

GRATIANO.
I am sorry to find you thus: I have been to seek you.

IAGO.
Lend me a garter:--so.--O, for a chair,
To bear him easily hence!

BIANCA.
Alas, he faints!--O Cassio, Cassio, Cassio!
-> IAGO
~~~
FABIAN.
This was a great argument of love in her toward you.

SIR ANDREW.
'Slight! will you make an ass o' me?

FABIAN.
I will prove it legitimate, sir, upon the oaths of judgment
and reason.

SIR TOBY.
And they have been grand jurymen since before Noah was a
sailor.
-> FABIAN
~~~
CHIEF JUSTICE.
Now, Master Gower, what news?

GOWER.
The king, my lord, and Harry Prince of Wales
Are near at hand:  the rest the paper tells.

FALSTAFF.
As I am a gentleman.

HOSTESS.
Faith, you said so before.
-> FALSTAFF
~~~
CHILDREN.
Ah for our father, for our dear Lord Clarence!

DUCHESS.
Alas for both, both mine, Edward and Clarence!

QUEEN ELIZABETH.
What stay had I but Edward? and he's gone.

CHILDREN.
What stay had we but Clarence? and he's gone.
-> DUCHESS
~~~
PANDARUS.
Pretty, i' faith.

CRESSIDA.
My lord, I do beseech you, pardon me;
'Twas not my purpose thus to beg a kiss.
I am asham'd. O heavens! what have I done?
For this time will I take my leave, my lord.

TROILUS.
Your leave, sweet Cressid!

PANDARUS.
Leave! An you take leave till to-morrow morning--
-> CRESSIDA
~~~
IAGO.
Do you hear, Cassio?

OTHELLO.
[Aside.] Now he importunes him
To tell it o'er: go to; well said, well said.

IAGO.
She gives it out that you shall marry her:
Do you intend it?

CASSIO.
Ha, ha, ha!
-> OTHELLO
~~~
FIRST CITIZEN.
We'll burn the house of Brutus.

THIRD CITIZEN.
Away, then! come, seek the conspirators.

ANTONY.
Yet hear me, countrymen; yet hear me speak.

CITIZENS.
Peace, ho! hear Antony; most noble Antony!
-> ANTONY
~~~
FIRST OFFICER.
This is the man; do thy office.

SECOND OFFICER.
Antonio, I arrest thee at the suit
Of Count Orsino.

ANTONIO.
You do mistake me, sir.

FIRST OFFICER.
No, sir, no jot; I know your favour well,
Though now you have no sea-cap on your head.--
Take him away; he knows I know him well.
-> ANTONIO
~~~
ULYSSES.
She will sing any man at first sight.

THERSITES.
And any man may sing her, if he can take her cliff; she's noted.

DIOMEDES.
Will you remember?

CRESSIDA.
Remember! Yes.
-> DIOMEDES
~~~
ROSS.
I have said.

MALCOLM.
Be comforted:
Let's make us medicines of our great revenge,
To cure this deadly grief.

MACDUFF.
He has no children.--All my pretty ones?
Did you say all?--O hell-kite!--All?
What, all my pretty chickens and their dam
At one fell swoop?

MALCOLM.
Dispute it like a man.
-> MACDUFF
~~~
LUCE.
Have at you with another: that's--When? can you tell?

DROMIO OF SYRACUSE.
If thy name be called Luce,--Luce, thou hast answer'd him well.

ANTIPHOLUS OF EPHESUS.
Do you hear, you minion? you'll let us in, I hope?

LUCE.
I thought to have ask'd you.
-> DROMIO OF SYRACUSE
~~~
KING.
If it were yours by none of all these ways,
How could you give it him?

DIANA.
I never gave it him.

LAFEU.
This woman's an easy glove, my lord; she goes off and on at
pleasure.

KING.
This ring was mine, I gave it his first wife.
-> DIANA
~~~
FAL.
Setting thy womanhood aside, thou art a beast to say otherwise.

HOST.
Say, what beast, thou knave, thou?

FAL.
What beast!  why, an otter.

PRINCE.
An otter, Sir John, why an otter?
-> FAL
~~~
TITUS.
Do you hear, sir?

SECOND VARRO'S SERVANT.
By your leave, sir.

FLAVIUS.
What do you ask of me, my friend?

TITUS.
We wait for certain money here, sir.
-> FLAVIUS
~~~
BERTRAM.
I shall stay here the forehorse to a smock,
Creaking my shoes on the plain masonry,
Till honour be bought up, and no sword worn
But one to dance with! By heaven, I'll steal away.

FIRST LORD.
There's honour in the theft.

PAROLLES.
Commit it, count.

SECOND LORD.
I am your accessary; and so farewell.
-> BERTRAM
~~~
THURIO.
Nay, then, the wanton lies; my face is black.

PROTEUS.
But pearls are fair; and the old saying is:
'Black men are pearls in beauteous ladies' eyes.'

JULIA.
[Aside] 'Tis true, such pearls as put out ladies' eyes;
For I had rather wink than look on them.

THURIO.
How likes she my discourse?
-> PROTEUS
~~~
EMILIA.
You told a lie; an odious, damned lie;
Upon my soul, a lie; a wicked lie:--
She false with Cassio!--Did you say with Cassio?

IAGO.
With Cassio, mistress. Go to, charm your tongue.

EMILIA.
I will not charm my tongue; I am bound to speak:
My mistress here lies murder'd in her bed,--

ALL.
O heavens forfend!
-> EMILIA
~~~
DUMAINE.
A Judas!

HOLOFERNES.
Not Iscariot, sir.
'Judas I am, ycliped Maccabaeus.'

DUMAINE.
Judas Maccabaeus clipt is plain Judas.

BEROWNE.
A kissing traitor. How art thou prov'd Judas?
-> HOLOFERNES
~~~
EMILIA.
Hath she forsook so many noble matches,
Her father, and her country, and her friends,
To be call'd whore? would it not make one weep?

DESDEMONA.
It is my wretched fortune.

IAGO.
Beshrew him for't!
How comes this trick upon him?

DESDEMONA.
Nay, heaven doth know.
-> EMILIA
~~~
LUCE.
I thought to have ask'd you.

DROMIO OF SYRACUSE.
And you said no.

DROMIO OF EPHESUS.
So, Come, help: well struck; there was blow for blow.

ANTIPHOLUS OF EPHESUS.
Thou baggage, let me in.
-> LUCE
""")


if __name__ == "__main__":
    import time

    import minillm

    model, tokenizer = minillm.load(minillm.DEFAULT_MODEL)
    start = time.perf_counter()
    curve = success_curve(model, tokenizer)
    print(format_curve(curve))
    print(f"{len(NEXT_SPEAKER_EXCERPTS)} excerpts, 64 candidates each, {time.perf_counter() - start:.1f} s")

