//! Invariants as named values that render to aggregation expressions over one document.
//!
//! An [`Invariant`] is a name plus an aggregation expression that is truthy when the
//! document satisfies it. The same expression is used in three places: over the document
//! *after* a change in a guarded update's pipeline, as the collection's `$jsonSchema`-free
//! `$expr` validator, and in the checker's `$match: {$expr: {$not: …}}`. Field names, and
//! the operators of a raw expression, are checked when an invariant is built, so a bad
//! name or an operator that is not an aggregation expression is an
//! [`Error::InvalidInput`] and never a malformed query; an operator the server turns out
//! not to know is mapped to the same error, naming the rule.

use mongodb::bson::{Bson, Document, doc};

use crate::error::{Error, Result};

/// The variable an element of an array is bound to inside a [`Condition`]
/// (`$$elem.field`). Use it in [`Condition::raw`].
pub const ELEMENT_VAR: &str = "elem";

/// The variable the document after a change is bound to inside a guarded update's filter.
pub(crate) const NEW_VAR: &str = "dw_new";

/// A comparison operator, rendered as the aggregation operator of the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CmpOp {
    /// `$eq`
    Eq,
    /// `$ne`
    Ne,
    /// `$gt`
    Gt,
    /// `$gte`
    Gte,
    /// `$lt`
    Lt,
    /// `$lte`
    Lte,
}

impl CmpOp {
    fn operator(self) -> &'static str {
        match self {
            CmpOp::Eq => "$eq",
            CmpOp::Ne => "$ne",
            CmpOp::Gt => "$gt",
            CmpOp::Gte => "$gte",
            CmpOp::Lt => "$lt",
            CmpOp::Lte => "$lte",
        }
    }
}

/// The right-hand side of a comparison: a constant, or another top-level field of the same
/// document (for example a `capacity` stored next to the bookings).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Operand {
    /// A constant, compared as a literal (a string starting with `$` is not a field path).
    Value(Bson),
    /// A field of the document, by dotted path.
    Field(String),
}

impl Operand {
    /// A constant operand.
    pub fn value(v: impl Into<Bson>) -> Self {
        Operand::Value(v.into())
    }

    /// A field of the document (dotted path allowed).
    pub fn field(path: impl Into<String>) -> Self {
        Operand::Field(path.into())
    }

    fn check(&self) -> Result<()> {
        match self {
            Operand::Value(_) => Ok(()),
            Operand::Field(p) => field_path("operand field", p),
        }
    }

    fn render(&self) -> Bson {
        match self {
            Operand::Value(v) => Bson::Document(doc! { "$literal": v.clone() }),
            Operand::Field(p) => Bson::String(format!("${p}")),
        }
    }
}

impl From<i32> for Operand {
    fn from(v: i32) -> Self {
        Operand::Value(v.into())
    }
}

impl From<i64> for Operand {
    fn from(v: i64) -> Self {
        Operand::Value(v.into())
    }
}

impl From<f64> for Operand {
    fn from(v: f64) -> Self {
        Operand::Value(v.into())
    }
}

impl From<bool> for Operand {
    fn from(v: bool) -> Self {
        Operand::Value(v.into())
    }
}

impl From<&str> for Operand {
    fn from(v: &str) -> Self {
        Operand::Value(v.into())
    }
}

/// A condition on one element of an array (evaluated with the element bound to
/// `$$elem`, so every part of it is about the same element: `$elemMatch` semantics).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Condition {
    /// `element.field <op> value`.
    Field {
        /// Field of the element (dotted path allowed).
        field: String,
        /// The comparison.
        op: CmpOp,
        /// The right-hand side (a constant; a [`Operand::Field`] refers to the document).
        value: Operand,
    },
    /// All of the conditions hold (true when empty).
    All(Vec<Condition>),
    /// Any of the conditions holds (false when empty).
    Any(Vec<Condition>),
    /// A raw aggregation expression; the element is `$$elem`.
    Raw(Document),
}

impl Condition {
    /// `element.field == value`.
    pub fn eq(field: impl Into<String>, value: impl Into<Operand>) -> Self {
        Self::cmp(field, CmpOp::Eq, value)
    }

    /// `element.field <op> value`.
    pub fn cmp(field: impl Into<String>, op: CmpOp, value: impl Into<Operand>) -> Self {
        Condition::Field {
            field: field.into(),
            op,
            value: value.into(),
        }
    }

    /// All of `conditions` hold for the same element.
    pub fn all(conditions: Vec<Condition>) -> Self {
        Condition::All(conditions)
    }

    /// Any of `conditions` holds.
    pub fn any(conditions: Vec<Condition>) -> Self {
        Condition::Any(conditions)
    }

    /// A raw aggregation expression over the element `$$elem`. It is checked as
    /// [`Invariant::raw`] checks its expression (an operator expression, every `$` key an
    /// aggregation expression operator) when the invariant using it is built, which then
    /// fails with [`Error::InvalidInput`] `{ what: "condition" }` naming the rule.
    pub fn raw(expr: Document) -> Self {
        Condition::Raw(expr)
    }

    fn check(&self) -> Result<()> {
        match self {
            Condition::Field { field, value, .. } => {
                field_path("condition field", field)?;
                value.check()
            }
            Condition::All(cs) | Condition::Any(cs) => cs.iter().try_for_each(Condition::check),
            Condition::Raw(d) => {
                operator_expression("condition", d)?;
                known_operators("condition", &Bson::Document(d.clone()))
            }
        }
    }

    /// The condition as an expression over `$$elem`, its comparisons rendered by `cmp`
    /// ([`compare`], or [`compare_before_17`] for the rendering of earlier versions).
    fn render(&self, cmp: Compare) -> Bson {
        let all = |cs: &[Condition]| cs.iter().map(|c| c.render(cmp)).collect::<Vec<_>>();
        match self {
            Condition::Field { field, op, value } => {
                cmp(*op, Bson::String(format!("$${ELEMENT_VAR}.{field}")), value)
            }
            Condition::All(cs) => Bson::Document(doc! { "$and": all(cs) }),
            Condition::Any(cs) => Bson::Document(doc! { "$or": all(cs) }),
            Condition::Raw(d) => Bson::Document(d.clone()),
        }
    }
}

/// A named rule over one document, rendered as an aggregation expression.
#[derive(Debug, Clone, PartialEq)]
pub struct Invariant {
    name: String,
    expr: Bson,
    /// How docwarden rendered the same rule before session 17 (ordering comparisons without
    /// the type bracket), when that differs from `expr`: a validator holding it was
    /// installed by an earlier docwarden ([`super::install_validator`] upgrades it).
    before_17: Option<Bson>,
}

impl Invariant {
    /// At least `n` elements of `array` satisfy `condition` ("at least one doctor on
    /// call"). A missing or non-array field counts as no elements.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad name or field path.
    pub fn at_least(
        name: impl Into<String>,
        array: &str,
        n: i64,
        condition: Condition,
    ) -> Result<Self> {
        Self::count(name.into(), array, "$gte", n, condition)
    }

    /// At most `n` elements of `array` satisfy `condition`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad name or field path.
    pub fn at_most(
        name: impl Into<String>,
        array: &str,
        n: i64,
        condition: Condition,
    ) -> Result<Self> {
        Self::count(name.into(), array, "$lte", n, condition)
    }

    fn count(name: String, array: &str, op: &str, n: i64, condition: Condition) -> Result<Self> {
        field_path("array", array)?;
        condition.check().map_err(|e| in_rule(&name, e))?;
        if n < 0 {
            return Err(Error::invalid("n", "a count bound must not be negative"));
        }
        let counted = |cmp: Compare| {
            let count = doc! {
                "$size": { "$filter": {
                    "input": as_array(array),
                    "as": ELEMENT_VAR,
                    "cond": condition.render(cmp),
                }}
            };
            Bson::Document(doc! { op: [count, n] })
        };
        Self::named(name, counted(compare))
            .map(|i| i.rendered_before_17(counted(compare_before_17)))
    }

    /// The sum of `field` over the elements of `array` is at most `cap` (seats booked ≤
    /// capacity, stock reserved ≤ stock). Non-numeric and missing values count as 0; `cap`
    /// may be a constant or a field of the document ([`Operand::field`]).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad name or field path.
    pub fn sum_at_most(
        name: impl Into<String>,
        array: &str,
        field: &str,
        cap: impl Into<Operand>,
    ) -> Result<Self> {
        field_path("array", array)?;
        field_path("field", field)?;
        let cap = cap.into();
        cap.check()?;
        if let Operand::Value(v) = &cap
            && !is_number(v)
        {
            return Err(Error::invalid(
                "cap",
                format!("`{v}` is not a number: a sum is below every string, date or document"),
            ));
        }
        let sum = doc! { "$sum": {
            "$map": { "input": as_array(array), "as": ELEMENT_VAR, "in": format!("$${ELEMENT_VAR}.{field}") }
        }};
        Self::named(
            name.into(),
            compare(CmpOp::Lte, Bson::Document(sum.clone()), &cap),
        )
        .map(|i| i.rendered_before_17(compare_before_17(CmpOp::Lte, Bson::Document(sum), &cap)))
    }

    /// `field <op> value` on the document (`balance >= 0`). An ordering comparison (`<`,
    /// `<=`, `>`, `>=`) holds only between values of the same type, numbers of every type
    /// together, as in MongoDB's query language (`{balance: {$gte: 0}}`): `balance >= 0`
    /// and `balance <= 100` both fail on a balance that is missing, null, a string, an
    /// array or a document (aggregation's own `$gte` orders every string above every
    /// number). `Eq` and `Ne` compare as `$eq` and `$ne` (`1 == 1.0`, `"1" != 1`).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad name or field path.
    pub fn field_cmp(
        name: impl Into<String>,
        field: &str,
        op: CmpOp,
        value: impl Into<Operand>,
    ) -> Result<Self> {
        field_path("field", field)?;
        let value = value.into();
        value.check()?;
        let left = Bson::String(format!("${field}"));
        Self::named(name.into(), compare(op, left.clone(), &value))
            .map(|i| i.rendered_before_17(compare_before_17(op, left, &value)))
    }

    /// Any aggregation expression over the document (`$field` paths, `$$ROOT`): the escape
    /// hatch for shapes the builders do not cover. `expr` must be an operator expression
    /// (one key, starting with `$`, such as `{$lte: ["$spent", "$budget"]}`): a document of
    /// plain fields is an object literal to the server, always true, so a query filter
    /// such as `{status: "active"}` passed here is refused rather than checking nothing.
    ///
    /// Every `$` key inside `expr` must be an aggregation expression operator MongoDB
    /// documents ([`EXPRESSION_OPERATORS`]), alone in its document: a typo (`$gtee`), a
    /// query operator (`{$exists: …}`, `$elemMatch`, `$regex`) or a document mixing an
    /// operator with other keys is refused here, where the server would refuse the first
    /// update that uses the rule. An operator of a newer MongoDB than the server's passes
    /// this check; the server's refusal is then [`Error::InvalidInput`] `{ what:
    /// "invariant" }` naming the rule, from the update, the checker or the validator.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad name, an `expr` (or an operand of its
    /// `$and`/`$or`/`$not`) that is not an operator expression, or a `$` key that is not
    /// an expression operator (the reason names the rule and the key).
    pub fn raw(name: impl Into<String>, expr: Document) -> Result<Self> {
        let name = name.into();
        operator_expression("expr", &expr).map_err(|e| in_rule(&name, e))?;
        known_operators("expr", &Bson::Document(expr.clone())).map_err(|e| in_rule(&name, e))?;
        Self::named(name, Bson::Document(expr))
    }

    fn named(name: String, expr: Bson) -> Result<Self> {
        crate::validate::name("invariant name", &name)?;
        Ok(Self {
            name,
            expr,
            before_17: None,
        })
    }

    /// Records `old`, the rendering of this rule before session 17, if it differs.
    fn rendered_before_17(mut self, old: Bson) -> Self {
        self.before_17 = (old != self.expr).then_some(old);
        self
    }

    /// The expressions earlier docwarden versions rendered for this rule where they differ
    /// from [`Invariant::expr`] (none for most rules): what a validator they installed
    /// holds.
    pub(crate) fn earlier_renderings(&self) -> impl Iterator<Item = &Bson> {
        self.before_17.iter()
    }

    /// The invariant's name (what [`super::GuardOutcome::Rejected`] reports).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The expression over the stored document (`$field` paths), as used in a validator.
    pub fn expr(&self) -> &Bson {
        &self.expr
    }

    /// The expression over the document bound to `$$<var>` instead of the stored one.
    pub(crate) fn expr_over(&self, var: &str) -> Bson {
        rebase(&self.expr, var)
    }
}

/// `{$and: [...]}` of every invariant's expression (true when there are none).
pub(crate) fn all_of(invariants: &[Invariant]) -> Bson {
    Bson::Document(doc! {
        "$and": invariants.iter().map(|i| i.expr.clone()).collect::<Vec<_>>()
    })
}

/// The aggregation expression operators of MongoDB's manual (through 8.x), and `$const`
/// (the server's own name for `$literal`, accepted since session 19): what a `$` key inside
/// an invariant's expression may be. Accumulators that are also expressions
/// (`$sum`, `$max`, `$median`, …) are in; stages, query-only operators (`$exists`,
/// `$elemMatch`, `$regex`), update operators and accumulators without an expression form
/// (`$push`, `$top`) are not.
#[rustfmt::skip]
pub const EXPRESSION_OPERATORS: &[&str] = &[
    "$abs", "$acos", "$acosh", "$add", "$allElementsTrue", "$and", "$anyElementTrue",
    "$arrayElemAt", "$arrayToObject", "$asin", "$asinh", "$atan", "$atan2", "$atanh", "$avg",
    "$binarySize", "$bitAnd", "$bitNot", "$bitOr", "$bitXor", "$bsonSize", "$ceil", "$cmp",
    "$concat", "$concatArrays", "$cond", "$const", "$convert", "$cos", "$cosh",
    "$createObjectId", "$dateAdd", "$dateDiff", "$dateFromParts", "$dateFromString",
    "$dateSubtract",
    "$dateToParts", "$dateToString", "$dateTrunc", "$dayOfMonth", "$dayOfWeek", "$dayOfYear",
    "$degreesToRadians", "$divide", "$eq", "$exp", "$filter", "$first", "$firstN", "$floor",
    "$function", "$getField", "$gt", "$gte", "$hour", "$ifNull", "$in", "$indexOfArray",
    "$indexOfBytes", "$indexOfCP", "$isArray", "$isNumber", "$isoDayOfWeek", "$isoWeek",
    "$isoWeekYear", "$last", "$lastN", "$let", "$literal", "$ln", "$log", "$log10", "$lt",
    "$lte", "$ltrim", "$map", "$max", "$maxN", "$median", "$mergeObjects", "$meta",
    "$millisecond", "$min", "$minN", "$minute", "$mod", "$month", "$multiply", "$ne", "$not",
    "$objectToArray", "$or", "$percentile", "$pow", "$radiansToDegrees", "$rand", "$range",
    "$reduce", "$regexFind", "$regexFindAll", "$regexMatch", "$replaceAll", "$replaceOne",
    "$reverseArray", "$round", "$rtrim", "$sampleRate", "$second", "$setDifference",
    "$setEquals", "$setField", "$setIntersection", "$setIsSubset", "$setUnion", "$sigmoid",
    "$sin", "$sinh", "$size", "$slice", "$sortArray", "$split", "$sqrt", "$stdDevPop",
    "$stdDevSamp", "$strLenBytes", "$strLenCP", "$strcasecmp", "$substr", "$substrBytes",
    "$substrCP", "$subtract", "$sum", "$switch", "$tan", "$tanh", "$toBool", "$toDate",
    "$toDecimal", "$toDouble", "$toHashedIndexKey", "$toInt", "$toLong", "$toLower",
    "$toObjectId", "$toString", "$toUUID", "$toUpper", "$trim", "$trunc", "$tsIncrement",
    "$tsSecond", "$type", "$unsetField", "$week", "$year", "$zip",
];

/// The operators whose argument is a constant, taken as it is: `$literal` and `$const`,
/// which MongoDB registers as one expression (`ExpressionConstant`, `$literal` being the
/// alias) and the embedded server accepts too. Nothing inside them is a field path or an
/// operator: the operator check, the server-refusal mapping and both rewrites onto the
/// document after a change leave their contents alone.
const LITERAL_OPERATORS: [&str; 2] = ["$literal", "$const"];

/// Whether `key` is one of [`LITERAL_OPERATORS`].
fn is_literal(key: &str) -> bool {
    LITERAL_OPERATORS.contains(&key)
}

/// Query-language operators that are not aggregation expressions, for a clearer refusal.
#[rustfmt::skip]
const QUERY_ONLY_OPERATORS: &[&str] = &[
    "$all", "$bitsAllClear", "$bitsAllSet", "$bitsAnyClear", "$bitsAnySet", "$comment",
    "$elemMatch", "$exists", "$expr", "$geoIntersects", "$geoWithin", "$jsonSchema", "$near",
    "$nearSphere", "$nin", "$nor", "$options", "$regex", "$text", "$where",
];

/// Checks every `$` key inside `expr` (outside `$literal`/`$const`): it must be one of
/// [`EXPRESSION_OPERATORS`] and the only key of its document. Keys without `$` (an object
/// literal, the named arguments of `$filter`, `$let`'s variables) are walked through.
fn known_operators(what: &'static str, expr: &Bson) -> Result<()> {
    match expr {
        Bson::Array(a) => a.iter().try_for_each(|b| known_operators(what, b)),
        Bson::Document(d) => {
            for (k, v) in d {
                if !k.starts_with('$') {
                    known_operators(what, v)?;
                    continue;
                }
                if d.len() > 1 {
                    return Err(Error::invalid(
                        what,
                        format!(
                            "`{d}` mixes the operator `{k}` with other keys: an operator must be the only key of its document"
                        ),
                    ));
                }
                if QUERY_ONLY_OPERATORS.contains(&k.as_str()) {
                    return Err(Error::invalid(
                        what,
                        format!(
                            "`{k}` is a query operator, not an aggregation expression (`{{$ne: [{{$type: \"$field\"}}, \"missing\"]}}` tests presence, `$regexMatch` a pattern)"
                        ),
                    ));
                }
                if !EXPRESSION_OPERATORS.contains(&k.as_str()) {
                    return Err(Error::invalid(
                        what,
                        format!("`{k}` is not an aggregation expression operator"),
                    ));
                }
                if !is_literal(k) {
                    known_operators(what, v)?;
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Prefixes an [`Error::InvalidInput`]'s reason with the rule it is about.
fn in_rule(name: &str, e: Error) -> Error {
    match e {
        Error::InvalidInput { what, reason } => Error::InvalidInput {
            what,
            reason: format!("rule `{name}`: {reason}"),
        },
        other => other,
    }
}

/// Every `$` key (operator) used in `expr`, outside `$literal`/`$const`.
fn operators_in<'a>(expr: &'a Bson, out: &mut Vec<&'a str>) {
    match expr {
        Bson::Array(a) => a.iter().for_each(|b| operators_in(b, out)),
        Bson::Document(d) => {
            for (k, v) in d {
                if k.starts_with('$') {
                    out.push(k);
                }
                if !is_literal(k) {
                    operators_in(v, out);
                }
            }
        }
        _ => {}
    }
}

/// A database error mapped to [`Error::InvalidInput`] `{ what: "invariant" }` when the
/// server refused an operator one of `invariants` uses (code 168,
/// `InvalidPipelineOperator`, or 31325, "Unknown expression", whose message names the
/// operator): an operator newer than the server, which [`Invariant::raw`]'s check lets
/// through. The first invariant (in the order given) using the named operator is named.
/// Any other error is [`Error::Database`]. Costs nothing unless the server refused.
pub(crate) fn refused_operator(err: impl Into<Error>, invariants: &[Invariant]) -> Error {
    let err = err.into();
    let Error::Database { source } = &err else {
        return err;
    };
    let Some(code) = crate::error::error_codes(source).find(|c| matches!(c, 168 | 31325)) else {
        return err;
    };
    // The server's message is in the write error, the command error or the bulk's
    // per-operation errors; the debug form holds all of them.
    let message = format!("{source:?}");
    let named = |op: &str| {
        message.match_indices(op).any(|(at, _)| {
            !message[at + op.len()..]
                .chars()
                .next()
                .is_some_and(char::is_alphanumeric)
        })
    };
    for inv in invariants {
        let mut ops = Vec::new();
        operators_in(&inv.expr, &mut ops);
        if let Some(op) = ops.into_iter().find(|op| named(op)) {
            return Error::invalid(
                "invariant",
                format!(
                    "rule `{}`: the server does not know the operator `{op}` (code {code}); nothing was written",
                    inv.name
                ),
            );
        }
    }
    err
}

/// Checks that `expr` is an operator expression: exactly one key, starting with `$`. An
/// expression document of plain fields is an object literal, which every server evaluates
/// as true, so an invariant written in query syntax (`{status: "active"}`, `{$and:
/// [{balance: {$gte: 0}}]}`) would hold on every document. The operands of `$and`, `$or`
/// and `$not` are checked too (where a query filter is most easily mistaken for an
/// expression); other operators' argument documents (`$filter`'s `{input, as, cond}`) have
/// plain keys by design and are left to the server.
fn operator_expression(what: &'static str, expr: &Document) -> Result<()> {
    let mut keys = expr.keys();
    let (Some(op), None) = (keys.next(), keys.next()) else {
        return Err(Error::invalid(
            what,
            format!(
                "`{expr}` is not an operator expression (one `$` key): a document of fields is an object literal, always true"
            ),
        ));
    };
    if !op.starts_with('$') || op.starts_with("$$") {
        return Err(Error::invalid(
            what,
            format!(
                "`{expr}` is not an operator expression (`{op}` is a field, not a `$` operator): a document of fields is an object literal, always true"
            ),
        ));
    }
    if matches!(op.as_str(), "$and" | "$or" | "$not") {
        let operands = match expr.get(op) {
            Some(Bson::Array(a)) => a.iter().collect::<Vec<_>>(),
            Some(other) => vec![other],
            None => Vec::new(),
        };
        for operand in operands {
            if let Bson::Document(d) = operand {
                operator_expression(what, d)?;
            }
        }
    }
    Ok(())
}

/// How a comparison is rendered: [`compare`], or [`compare_before_17`].
type Compare = fn(CmpOp, Bson, &Operand) -> Bson;

/// `{op: [left, right]}` alone: how every comparison was rendered before session 17, which
/// added the type bracket to ordering comparisons ([`compare`]). Kept to recognise the
/// validators earlier versions installed.
fn compare_before_17(op: CmpOp, left: Bson, right: &Operand) -> Bson {
    Bson::Document(doc! { op.operator(): [left, right.render()] })
}

/// `{op: [left, right]}`; an ordering comparison also requires both sides to be in the
/// same type bracket, as MongoDB's query language does (`{f: {$gte: 0}}` matches numbers
/// only), where aggregation's `$gte` alone follows the BSON type order (every string,
/// document, array, boolean and date above every number: `"-5" >= 0`). Numbers of every
/// type are one bracket; a null right-hand side is left to the BSON order (null and
/// missing at the bottom). `$eq`/`$ne` are unchanged (already false across brackets).
fn compare(op: CmpOp, left: Bson, right: &Operand) -> Bson {
    let cmp = compare_before_17(op, left.clone(), right);
    if matches!(op, CmpOp::Eq | CmpOp::Ne) {
        return cmp;
    }
    let same_bracket = match right {
        Operand::Value(Bson::Null | Bson::Undefined) => return cmp,
        Operand::Value(v) if is_number(v) => doc! { "$isNumber": [left] },
        Operand::Value(v) => doc! { "$eq": [{ "$type": [left] }, { "$literal": type_alias(v) }] },
        Operand::Field(_) => doc! { "$eq": [bracket(left), bracket(right.render())] },
    };
    Bson::Document(doc! { "$and": [same_bracket, cmp] })
}

/// The type bracket of `value` at run time: `"number"` for every numeric type, else its
/// `$type` alias.
fn bracket(value: Bson) -> Document {
    doc! { "$cond": [{ "$isNumber": [value.clone()] }, "number", { "$type": [value] }] }
}

/// Whether a constant is a number (int, long, double, decimal).
fn is_number(v: &Bson) -> bool {
    matches!(
        v,
        Bson::Int32(_) | Bson::Int64(_) | Bson::Double(_) | Bson::Decimal128(_)
    )
}

/// The `$type` alias of a constant (the string the aggregation operator returns).
fn type_alias(v: &Bson) -> &'static str {
    match v {
        Bson::Double(_) => "double",
        Bson::String(_) => "string",
        Bson::Document(_) => "object",
        Bson::Array(_) => "array",
        Bson::Binary(_) => "binData",
        Bson::Undefined => "undefined",
        Bson::ObjectId(_) => "objectId",
        Bson::Boolean(_) => "bool",
        Bson::DateTime(_) => "date",
        Bson::Null => "null",
        Bson::RegularExpression(_) => "regex",
        Bson::DbPointer(_) => "dbPointer",
        Bson::JavaScriptCode(_) => "javascript",
        Bson::Symbol(_) => "symbol",
        Bson::JavaScriptCodeWithScope(_) => "javascriptWithScope",
        Bson::Int32(_) => "int",
        Bson::Timestamp(_) => "timestamp",
        Bson::Int64(_) => "long",
        Bson::Decimal128(_) => "decimal",
        Bson::MinKey => "minKey",
        Bson::MaxKey => "maxKey",
    }
}

/// `$array` when it is an array, `[]` otherwise (so a missing field counts as empty and a
/// malformed one never makes the whole query fail).
fn as_array(array: &str) -> Document {
    doc! { "$cond": [{ "$isArray": format!("${array}") }, format!("${array}"), []] }
}

/// Checks a dotted field path: non-empty segments, none starting with `$`, no NUL.
pub(crate) fn field_path(what: &'static str, path: &str) -> Result<()> {
    crate::validate::name(what, path)?;
    if path.split('.').any(|s| s.is_empty() || s.starts_with('$')) {
        return Err(Error::invalid(
            what,
            format!("`{path}` is not a field path (empty segment or `$`)"),
        ));
    }
    Ok(())
}

/// Checks a top-level field name (no dots).
pub(crate) fn field_name(what: &'static str, name: &str) -> Result<()> {
    field_path(what, name)?;
    if name.contains('.') {
        return Err(Error::invalid(
            what,
            format!("`{name}` must be a top-level field (no dots)"),
        ));
    }
    Ok(())
}

/// Rewrites an expression over the current document into one over `$$var`: every field
/// path `"$a.b"` becomes `"$$var.a.b"`, `$$ROOT` / `$$CURRENT` become `$$var`, and a
/// `$getField` without `input` (which reads the current document) gets `input: "$$var"`. In an
/// aggregation expression a string starting with one `$` is always a field path, so the
/// rewrite is exact; `$literal` and `$const` contents are left alone.
pub(crate) fn rebase(expr: &Bson, var: &str) -> Bson {
    match expr {
        Bson::String(s) => Bson::String(rebase_str(s, var)),
        Bson::Array(a) => Bson::Array(a.iter().map(|b| rebase(b, var)).collect()),
        Bson::Document(d) => {
            let mut out = Document::new();
            for (k, v) in d {
                if is_literal(k) {
                    out.insert(k.clone(), v.clone());
                } else if k == "$getField" && reads_current(v) {
                    out.insert(k.clone(), get_field_from(v, var));
                } else {
                    out.insert(k.clone(), rebase(v, var));
                }
            }
            Bson::Document(out)
        }
        other => other.clone(),
    }
}

/// The long form of a `$getField` argument (`{field, input}`), or `None` for the short
/// form (`"a.b"`, `{$literal: "$a"}`: the field name alone).
fn get_field_long_form(arg: &Bson) -> Option<&Document> {
    arg.as_document().filter(|d| d.contains_key("field"))
}

/// Whether a `$getField` argument reads the current document: the short form (a field
/// name, which may hold dots or `$`) or the long form without `input`.
fn reads_current(arg: &Bson) -> bool {
    get_field_long_form(arg).is_none_or(|d| !d.contains_key("input"))
}

/// A `$getField` argument that reads the current document, made to read `$$var`.
fn get_field_from(arg: &Bson, var: &str) -> Bson {
    let mut out = match get_field_long_form(arg) {
        Some(d) => d.clone(),
        None => doc! { "field": arg.clone() },
    };
    out.insert("input", format!("$${var}"));
    Bson::Document(out)
}

/// Rewrites an expression so that paths into top-level `field` read the path `to` instead
/// (`$field.a` becomes `<to>.a`; `to` is where the field's new value is, such as
/// `$field.new`) and every other path reads the stored document. `None` if the expression
/// refers to the whole document (`$$ROOT`, `$$CURRENT`, a `$getField` without `input`),
/// which needs [`rebase`].
pub(crate) fn rebase_field(expr: &Bson, field: &str, to: &str) -> Option<Bson> {
    rebase_path(expr, &format!("${field}"), to)
}

/// [`rebase_field`] with its paths built once: `whole` is `$field`.
fn rebase_path(expr: &Bson, whole: &str, to: &str) -> Option<Bson> {
    Some(match expr {
        Bson::String(s) => {
            if s.starts_with("$$ROOT") || s.starts_with("$$CURRENT") {
                return None;
            }
            match s.strip_prefix(whole) {
                Some("") => Bson::String(to.to_owned()),
                Some(rest) if rest.starts_with('.') => Bson::String(format!("{to}{rest}")),
                _ => Bson::String(s.clone()),
            }
        }
        Bson::Array(a) => Bson::Array(
            a.iter()
                .map(|b| rebase_path(b, whole, to))
                .collect::<Option<Vec<_>>>()?,
        ),
        Bson::Document(d) => {
            let mut out = Document::new();
            for (k, v) in d {
                if is_literal(k) {
                    out.insert(k.clone(), v.clone());
                } else if k == "$getField" && reads_current(v) {
                    // Reads the whole document by name, not by path: bind it.
                    return None;
                } else {
                    out.insert(k.clone(), rebase_path(v, whole, to)?);
                }
            }
            Bson::Document(out)
        }
        other => other.clone(),
    })
}

fn rebase_str(s: &str, var: &str) -> String {
    for root in ["$$ROOT", "$$CURRENT"] {
        if s == root {
            return format!("$${var}");
        }
        if let Some(rest) = s.strip_prefix(root).and_then(|r| r.strip_prefix('.')) {
            return format!("$${var}.{rest}");
        }
    }
    if s.starts_with("$$") {
        return s.to_owned();
    }
    match s.strip_prefix('$') {
        Some(path) => format!("$${var}.{path}"),
        None => s.to_owned(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn at_least_renders_a_filtered_count() {
        let inv =
            Invariant::at_least("on_call", "doctors", 1, Condition::eq("on_call", true)).unwrap();
        assert_eq!(inv.name(), "on_call");
        let expected = Bson::Document(doc! { "$gte": [
            { "$size": { "$filter": {
                "input": { "$cond": [{ "$isArray": "$doctors" }, "$doctors", []] },
                "as": "elem",
                "cond": { "$eq": ["$$elem.on_call", { "$literal": true }] },
            }}},
            1_i64,
        ]});
        assert_eq!(inv.expr(), &expected);
    }

    #[test]
    fn rebase_rewrites_field_paths_only() {
        let e = Bson::Document(doc! {
            "$and": [
                { "$gte": ["$balance", { "$literal": "$not_a_path" }] },
                { "$eq": ["$$ROOT.a", "$$elem.b"] },
                { "$eq": ["$$CURRENT", "plain"] },
            ]
        });
        let r = rebase(&e, "n");
        assert_eq!(
            r,
            Bson::Document(doc! {
                "$and": [
                    { "$gte": ["$$n.balance", { "$literal": "$not_a_path" }] },
                    { "$eq": ["$$n.a", "$$elem.b"] },
                    { "$eq": ["$$n", "plain"] },
                ]
            })
        );
    }

    #[test]
    fn rebase_field_rewrites_only_the_changed_field() {
        let e = Bson::Document(doc! { "$lte": [
            { "$sum": "$bookings.seats" }, "$capacity", "$bookingsX", "$bookings"
        ]});
        assert_eq!(
            rebase_field(&e, "bookings", "$bookings.new"),
            Some(Bson::Document(doc! { "$lte": [
                { "$sum": "$bookings.new.seats" }, "$capacity", "$bookingsX", "$bookings.new"
            ]}))
        );
        let root = Bson::Document(doc! { "$eq": ["$$ROOT.a", 1] });
        assert_eq!(rebase_field(&root, "a", "$a.new"), None);
    }

    #[test]
    fn bad_names_are_refused() {
        assert!(Invariant::field_cmp("", "balance", CmpOp::Gte, 0).is_err());
        assert!(Invariant::field_cmp("x", "$balance", CmpOp::Gte, 0).is_err());
        assert!(Invariant::field_cmp("x", "a..b", CmpOp::Gte, 0).is_err());
        assert!(Invariant::at_least("x", "d", -1, Condition::eq("a", 1)).is_err());
        assert!(Invariant::at_least("x", "d", 1, Condition::eq("", 1)).is_err());
        assert!(Invariant::sum_at_most("x", "bookings", "seats", Operand::field("cap$")).is_ok());
        assert!(field_name("f", "a.b").is_err());
        assert!(field_name("f", "ab").is_ok());
    }

    #[test]
    fn sum_and_field_cmp_render() {
        let s =
            Invariant::sum_at_most("cap", "bookings", "seats", Operand::field("capacity")).unwrap();
        let Bson::Document(d) = s.expr() else {
            panic!("document")
        };
        let and = d.get_array("$and").unwrap();
        let args = and[1].as_document().unwrap().get_array("$lte").unwrap();
        assert_eq!(args[1], Bson::String("$capacity".into()));
        let f = Invariant::field_cmp("nonneg", "balance", CmpOp::Gte, 0_i64).unwrap();
        assert_eq!(
            f.expr(),
            &Bson::Document(doc! { "$and": [
                { "$isNumber": ["$balance"] },
                { "$gte": ["$balance", { "$literal": 0_i64 }] },
            ]})
        );
        let e = Invariant::field_cmp("same", "balance", CmpOp::Eq, 0_i64).unwrap();
        assert_eq!(
            e.expr(),
            &Bson::Document(doc! { "$eq": ["$balance", { "$literal": 0_i64 }] })
        );
        assert!(Invariant::sum_at_most("cap", "bookings", "seats", "ten").is_err());
    }
}
